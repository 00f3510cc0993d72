//! Error chains: one way to print an error with its causes ([`Chain`]),
//! and one way to ask for a cause by its type ([`find`], linkerd's
//! `is_caused_by`), so a decision never depends on an error's text.
//!
//! [`find`] also looks *inside* the wrappers whose `source()` hides their
//! payload: a custom `io::Error` answers its payload's source, not the
//! payload (tokio-rustls and hyper-rustls wrap rustls errors that way), and
//! redis-rs keeps a cause behind an `Arc<dyn Error>` that downcasts as the
//! `Arc`.

use std::error::Error;
use std::fmt;
use std::sync::Arc;

type DynError = dyn Error + 'static;

/// A cause of any type, kept as a source to be [`find`]-able.
pub type BoxError = Box<dyn Error + Send + Sync>;

/// "outer: cause: cause", each cause once: one whose text the line already
/// shows (an outer error that prints its cause itself) is left out.
pub struct Chain<'a>(pub &'a DynError);

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut line = self.0.to_string();
        for cause in std::iter::successors(self.0.source(), |&e| e.source()) {
            let text = cause.to_string();
            if !line.contains(&text) {
                line.push_str(": ");
                line.push_str(&text);
            }
        }
        f.write_str(&line)
    }
}

/// The first error of type `E` in `err`'s chain (`err` included), looking
/// inside `io::Error` and `Arc<dyn Error>` wrappers.
pub fn find<E: Error + 'static>(err: &DynError) -> Option<&E> {
    std::iter::successors(Some(err), |&e| e.source())
        .flat_map(unwrapped)
        .find_map(|e| e.downcast_ref::<E>())
}

/// `e`, then what each wrapper around it holds, outermost first.
fn unwrapped(e: &DynError) -> impl Iterator<Item = &DynError> {
    std::iter::successors(Some(e), |&e| {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            io.get_ref().map(|inner| inner as &DynError)
        } else {
            e.downcast_ref::<Arc<dyn Error + Send + Sync>>()
                .map(|arc| &**arc as &DynError)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("{0}")]
    struct Layer(&'static str, #[source] Box<dyn Error + Send + Sync>);

    fn layer(text: &'static str, cause: impl Error + Send + Sync + 'static) -> Layer {
        Layer(text, Box::new(cause))
    }

    #[test]
    fn a_chain_shows_each_cause_once() {
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let err = layer("client error", layer("tcp connect error", refused));
        let want = "client error: tcp connect error: refused";
        assert_eq!(Chain(&err).to_string(), want);
        // An outer error that prints its cause itself (redis-rs does).
        let repeated = layer("io: refused", layer("refused", std::fmt::Error));
        let want = "io: refused: an error occurred when formatting an argument";
        assert_eq!(Chain(&repeated).to_string(), want);
    }

    #[test]
    fn find_looks_through_sources_and_the_wrappers_that_hide_them() {
        let tls = || rustls::Error::HandshakeNotComplete;
        // tokio-rustls wraps once, hyper-rustls again.
        let twice = std::io::Error::other(std::io::Error::other(tls()));
        assert_eq!(find::<rustls::Error>(&twice), Some(&tls()));
        // redis-rs: the io::Error behind an Arc, the Arc as the source.
        let arc: Arc<dyn Error + Send + Sync> = Arc::new(std::io::Error::other(tls()));
        assert_eq!(find::<rustls::Error>(&layer("io", arc)), Some(&tls()));
        let deep = layer("a", layer("b", std::fmt::Error));
        assert!(find::<std::fmt::Error>(&deep).is_some());
        assert!(find::<rustls::Error>(&deep).is_none());
    }
}
