//! The request fingerprint: sha256 over method, path, query, the route's
//! configured headers and the body (IETF draft §2.4). Each part is
//! length-prefixed so no two different requests can hash the same input.

use sha2::{Digest, Sha256};
use std::fmt;

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// `headers` are the route's `fingerprint_headers`, in config order;
    /// an absent header and an empty one hash differently.
    pub fn compute(
        method: &http::Method,
        path: &str,
        query: Option<&str>,
        headers: &[(&http::HeaderName, Vec<&[u8]>)],
        body: &[u8],
    ) -> Self {
        let mut h = Sha256::new();
        h.update(b"idemgate/fingerprint/v1");
        let mut part = |bytes: &[u8]| {
            h.update((bytes.len() as u64).to_be_bytes());
            h.update(bytes);
        };
        part(method.as_str().as_bytes());
        part(path.as_bytes());
        match query {
            Some(q) => {
                part(b"?");
                part(q.as_bytes());
            }
            None => part(b""),
        }
        for (name, values) in headers {
            part(name.as_str().as_bytes());
            part(&(values.len() as u64).to_be_bytes());
            for v in values {
                part(v);
            }
        }
        part(body);
        Self(h.finalize().into())
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &self.to_hex()[..12])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderName, Method};

    fn fp(method: &str, path: &str, query: Option<&str>, body: &[u8]) -> Fingerprint {
        Fingerprint::compute(&method.parse::<Method>().unwrap(), path, query, &[], body)
    }

    #[test]
    fn every_part_changes_the_fingerprint() {
        let base = fp("POST", "/orders", Some("a=1"), b"{}");
        assert_eq!(base, fp("POST", "/orders", Some("a=1"), b"{}"));
        let variants = [
            fp("PUT", "/orders", Some("a=1"), b"{}"),
            fp("POST", "/orders/1", Some("a=1"), b"{}"),
            fp("POST", "/orders", Some("a=2"), b"{}"),
            fp("POST", "/orders", None, b"{}"),
            fp("POST", "/orders", Some(""), b"{}"),
            fp("POST", "/orders", Some("a=1"), b"{ }"),
            fp("POST", "/orders", Some("a=1"), b""),
        ];
        for (i, v) in variants.iter().enumerate() {
            assert_ne!(&base, v, "variant {i}");
        }
    }

    #[test]
    fn boundaries_between_parts_matter() {
        // Without length prefixes "/ab" + "c" and "/a" + "bc" could collide.
        assert_ne!(
            fp("POST", "/ab", Some("c"), b""),
            fp("POST", "/a", Some("bc"), b"")
        );
        assert_ne!(fp("POST", "/a", None, b"bc"), fp("POST", "/ab", None, b"c"));
    }

    #[test]
    fn configured_headers_are_included() {
        let name = HeaderName::from_static("x-tenant");
        let m = Method::POST;
        let a = Fingerprint::compute(&m, "/o", None, &[(&name, vec![b"1".as_slice()])], b"");
        let b = Fingerprint::compute(&m, "/o", None, &[(&name, vec![b"2".as_slice()])], b"");
        let absent = Fingerprint::compute(&m, "/o", None, &[(&name, vec![])], b"");
        let empty = Fingerprint::compute(&m, "/o", None, &[(&name, vec![b"".as_slice()])], b"");
        assert_ne!(a, b);
        assert_ne!(absent, empty);
    }
}
