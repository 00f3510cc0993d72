//! The `Idempotency-Key` parser on any header value: it never panics, it
//! accepts exactly the documented keys (1 to 255 printable ASCII
//! characters, bare or as an RFC 9651 sf-string), and the quoted and bare
//! spellings of a key are the same key.
#![no_main]

use idemgate::idempotency::key::MAX_KEY_LEN;
use idemgate::idempotency::{IdempotencyKey, KeyError};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|raw: &[u8]| {
    let parsed = IdempotencyKey::parse(raw);
    let trimmed = raw
        .iter()
        .position(|b| !matches!(b, b' ' | b'\t'))
        .map_or(&raw[..0], |start| {
            let end = raw
                .iter()
                .rposition(|b| !matches!(b, b' ' | b'\t'))
                .unwrap_or(start);
            &raw[start..=end]
        });
    let printable = |b: &u8| (0x20..=0x7e).contains(b);
    if trimmed.first() != Some(&b'"') {
        // The bare form: the value itself, after optional whitespace.
        let want = if trimmed.is_empty() {
            Err(KeyError::Empty)
        } else if !trimmed.iter().all(printable) {
            Err(KeyError::NotPrintable)
        } else if trimmed.len() > MAX_KEY_LEN {
            Err(KeyError::TooLong)
        } else {
            Ok(trimmed)
        };
        assert_eq!(
            parsed
                .as_ref()
                .map(|k| k.as_str().as_bytes())
                .map_err(Clone::clone),
            want,
        );
    }
    let Ok(key) = parsed else { return };
    let text = key.as_str();
    assert!(!text.is_empty() && text.len() <= MAX_KEY_LEN);
    assert!(text.bytes().all(|b| printable(&b)));
    // The sf-string spelling of any key is that key.
    let quoted = quote(text);
    assert_eq!(IdempotencyKey::parse(quoted.as_bytes()).as_ref(), Ok(&key));
    // And so is the bare one, wherever the bare form can say it.
    let bare_is_unambiguous = !text.starts_with('"') && text.trim_matches([' ', '\t']) == text;
    if bare_is_unambiguous {
        assert_eq!(IdempotencyKey::parse(text.as_bytes()).as_ref(), Ok(&key));
    }
    // Read from a header map, one field: the same answer.
    if let Ok(value) = http::HeaderValue::from_bytes(raw) {
        let name = http::HeaderName::from_static("idempotency-key");
        let mut headers = http::HeaderMap::new();
        headers.insert(&name, value);
        let sent: Vec<&[u8]> = headers
            .get_all(&name)
            .iter()
            .map(|v| v.as_bytes())
            .collect();
        assert_eq!(IdempotencyKey::from_fields(&sent), Ok(Some(key)));
    }
});

/// RFC 9651 §4.1.6: the sf-string serialization of `s`.
fn quote(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        if matches!(c, '"' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}
