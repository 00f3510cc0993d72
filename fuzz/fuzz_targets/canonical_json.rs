//! RFC 8785 canonical JSON on any bytes: never panics, never overflows the
//! stack (nesting is bounded), and the canonical form of an accepted
//! document is accepted again and is its own canonical form.
#![no_main]

use idemgate::idempotency::canonical_json::canonicalize;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|raw: &[u8]| {
    if let Ok(once) = canonicalize(raw) {
        let twice = canonicalize(&once).expect("canonical output is accepted");
        assert_eq!(once, twice);
    }
});
