//! The request id: the client's `X-Request-Id` when it is sane, or a new
//! one. It is forwarded upstream, returned on the response (replays too:
//! the id is the current request's, the stored body stays byte for byte),
//! logged in the access line and carried by every problem+json as its
//! `instance` (`urn:idemgate:request:<id>`).

use http::{HeaderMap, HeaderName, HeaderValue};

pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Longer ids are replaced: they end up in every log line.
const MAX_LEN: usize = 128;

/// One request's id: 1 to [`MAX_LEN`] characters of `A-Z a-z 0-9 - _ . : + / = @`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestId(HeaderValue);

impl RequestId {
    /// The client's id if it sent exactly one sane one, else a new one.
    pub fn of_request(headers: &HeaderMap) -> Self {
        let mut sent = headers.get_all(&X_REQUEST_ID).iter();
        match (sent.next(), sent.next()) {
            (Some(v), None) if is_sane(v.as_bytes()) => Self(v.clone()),
            _ => Self::generate(),
        }
    }

    /// 128 random bits as 32 hex digits.
    pub fn generate() -> Self {
        // By hand: `format!` of a u128 cost more than the rest of the id.
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let bits = rand::random::<u128>();
        let mut hex = [0u8; 32];
        for (i, digit) in hex.iter_mut().enumerate() {
            *digit = HEX[((bits >> (124 - 4 * i)) & 0xf) as usize];
        }
        Self(HeaderValue::from_bytes(&hex).expect("hex is a valid header value"))
    }

    pub fn as_str(&self) -> &str {
        // Only sane (ASCII) values are ever held.
        self.0.to_str().unwrap_or_default()
    }

    pub fn header_value(&self) -> HeaderValue {
        self.0.clone()
    }

    /// The problem+json `instance` (RFC 9457 §3.1.5): a URI naming this
    /// occurrence, which an operator finds in the access log by its id.
    pub fn instance(&self) -> String {
        format!("urn:idemgate:request:{}", self.as_str())
    }
}

fn is_sane(v: &[u8]) -> bool {
    (1..=MAX_LEN).contains(&v.len())
        && v.iter()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:+/=@".contains(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_sane_ids_and_replaces_the_rest() {
        let of = |values: &[&[u8]]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(X_REQUEST_ID, HeaderValue::from_bytes(v).unwrap());
            }
            RequestId::of_request(&h)
        };
        for kept in [
            &b"abc-123"[..],
            b"4bf92f3577b34da6a3ce929d0e0e4736",
            b"req_01H:x/y+z=@a.b",
        ] {
            assert_eq!(of(&[kept]).as_str().as_bytes(), kept);
        }
        let long = [b'a'; MAX_LEN + 1];
        for replaced in [&b""[..], b"has space", b"semi;colon", b"quote\"", &long[..]] {
            let id = of(&[replaced]);
            assert_eq!(id.as_str().len(), 32, "{replaced:?}");
            assert!(id.as_str().bytes().all(|b| b.is_ascii_hexdigit()));
        }
        assert_eq!(
            of(&[b"a", b"b"]).as_str().len(),
            32,
            "two ids: neither is trusted"
        );
        assert_eq!(of(&[]).as_str().len(), 32);
        assert_ne!(RequestId::generate(), RequestId::generate());
        assert_eq!(of(&[b"abc"]).instance(), "urn:idemgate:request:abc");
    }
}
