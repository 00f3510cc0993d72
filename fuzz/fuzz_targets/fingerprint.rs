//! The request fingerprint on any two requests for one route: computing it
//! never panics, and two requests get the same fingerprint exactly when
//! their method, normalized path, query, fingerprinted header values and
//! body are the same (every part is length-prefixed, so no boundary can
//! be moved to forge a collision).
#![no_main]

use http::{HeaderName, Method};
use idemgate::fuzzing::normalize_path;
use idemgate::idempotency::Fingerprint;
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

/// What the fingerprint covers, as compared.
#[derive(Debug, PartialEq)]
struct Covered {
    method: Method,
    path: String,
    query: Option<String>,
    headers: Vec<Vec<Vec<u8>>>,
    body: Vec<u8>,
}

const METHODS: [&str; 5] = ["POST", "PUT", "PATCH", "DELETE", "POS"];

fn names() -> [HeaderName; 2] {
    [
        HeaderName::from_static("x-tenant"),
        HeaderName::from_static("content-type"),
    ]
}

fn request(u: &mut Unstructured<'_>) -> Result<Option<(Fingerprint, Covered)>> {
    let method = match u.int_in_range(0..=METHODS.len())? {
        i if i < METHODS.len() => METHODS[i].to_string(),
        _ => u.arbitrary()?,
    };
    let target: String = u.arbitrary()?;
    let mut builder = http::Request::builder()
        .method(method.as_str())
        .uri(target.as_str());
    for name in names() {
        for _ in 0..u.int_in_range(0..=2)? {
            builder = builder.header(&name, u.arbitrary::<Vec<u8>>()?);
        }
    }
    let body: Vec<u8> = u.arbitrary()?;
    let Ok(req) = builder.body(()) else {
        return Ok(None);
    };
    let (parts, ()) = req.into_parts();
    let path = normalize_path(parts.uri.path()).into_owned();
    let covered_names = names();
    let sent: Vec<(&HeaderName, Vec<&[u8]>)> = covered_names
        .iter()
        .map(|n| {
            (
                n,
                parts
                    .headers
                    .get_all(n)
                    .iter()
                    .map(|v| v.as_bytes())
                    .collect(),
            )
        })
        .collect();
    let fingerprint = Fingerprint::compute(&parts.method, &path, parts.uri.query(), &sent, &body);
    let covered = Covered {
        method: parts.method.clone(),
        path,
        query: parts.uri.query().map(str::to_string),
        headers: names()
            .iter()
            .map(|n| {
                parts
                    .headers
                    .get_all(n)
                    .iter()
                    .map(|v| v.as_bytes().to_vec())
                    .collect()
            })
            .collect(),
        body,
    };
    Ok(Some((fingerprint, covered)))
}

fuzz_target!(|raw: &[u8]| {
    let mut u = Unstructured::new(raw);
    let (Ok(Some(a)), Ok(Some(b))) = (request(&mut u), request(&mut u)) else {
        return;
    };
    assert_eq!(a.0 == b.0, a.1 == b.1, "{:?} / {:?}", a.1, b.1);
    // And it is a function of those parts only.
    let again = Fingerprint::compute(
        &a.1.method,
        &a.1.path,
        a.1.query.as_deref(),
        &names()
            .iter()
            .zip(&a.1.headers)
            .map(|(n, vs)| (n, vs.iter().map(Vec::as_slice).collect()))
            .collect::<Vec<_>>(),
        &a.1.body,
    );
    assert_eq!(again, a.0);
});
