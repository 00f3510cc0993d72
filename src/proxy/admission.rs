//! What every proxied request must satisfy before route lookup, protected
//! or not: rules hyper leaves to the application. A request that breaks one
//! is answered here and never forwarded.
//!
//! - Transfer-codings (RFC 9112 §6.1): hyper decodes a final `chunked` and
//!   passes any coding before it through, so `gzip, chunked` would reach
//!   the upstream as a plain chunked body of gzip bytes. Only `chunked` is
//!   understood; anything else is 501, `chunked` twice is 400. (HTTP/2
//!   carries no transfer-codings: h2 resets such a stream itself.)

use crate::error::ProxyError;
use http::{header, HeaderMap, Request};

/// The longest coding name a problem's detail repeats back.
const MAX_ECHOED_CODING: usize = 32;

/// Why a request is malformed in a way hyper does not catch (400).
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("the chunked transfer-coding is applied more than once")]
    ChunkedTwice,
}

/// Checks `req` against the rules above.
pub fn admit<B>(req: &Request<B>) -> Result<(), ProxyError> {
    transfer_codings(req.headers())
}

/// Every coding in every `Transfer-Encoding` field must be `chunked`, once.
fn transfer_codings(headers: &HeaderMap) -> Result<(), ProxyError> {
    let mut chunked = 0;
    for value in headers.get_all(header::TRANSFER_ENCODING) {
        let text = String::from_utf8_lossy(value.as_bytes());
        // A list may hold empty elements (RFC 9110 §5.6.1).
        for coding in text.split(',').map(str::trim).filter(|c| !c.is_empty()) {
            if !coding.eq_ignore_ascii_case("chunked") {
                let coding = coding.chars().take(MAX_ECHOED_CODING).collect();
                return Err(ProxyError::UnsupportedTransferCoding { coding });
            }
            chunked += 1;
        }
    }
    if chunked > 1 {
        return Err(ProxyError::InvalidRequest(RequestError::ChunkedTwice));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admitted(fields: &[(&str, &str)]) -> Result<(), ProxyError> {
        let mut req = Request::post("/orders");
        for (name, value) in fields {
            req = req.header(*name, *value);
        }
        admit(&req.body(()).unwrap())
    }

    #[test]
    fn only_chunked_once_is_understood() {
        let te = "transfer-encoding";
        for ok in [&[][..], &[(te, "chunked")], &[(te, "Chunked , ")]] {
            assert!(admitted(ok).is_ok(), "{ok:?}");
        }
        for unsupported in [
            &[(te, "gzip, chunked")][..],
            &[(te, "gzip"), (te, "chunked")],
            &[(te, "chunked;x=1")],
            &[(te, "identity")],
        ] {
            assert!(
                matches!(
                    admitted(unsupported),
                    Err(ProxyError::UnsupportedTransferCoding { .. })
                ),
                "{unsupported:?}"
            );
        }
        for twice in [
            &[(te, "chunked, chunked")][..],
            &[(te, "chunked"), (te, "chunked")],
        ] {
            assert!(
                matches!(
                    admitted(twice),
                    Err(ProxyError::InvalidRequest(RequestError::ChunkedTwice))
                ),
                "{twice:?}"
            );
        }
        let long = format!("{}, chunked", "x".repeat(100));
        match admitted(&[(te, &long)]) {
            Err(ProxyError::UnsupportedTransferCoding { coding }) => {
                assert_eq!(coding.len(), MAX_ECHOED_CODING)
            }
            other => panic!("{other:?}"),
        }
    }
}
