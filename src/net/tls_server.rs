//! TLS on the listeners (the proxy's and the admin's), written once: the
//! certificate and key (PEM files, checked to match), the optional client
//! CA (mTLS: a client without a certificate chaining to it is refused),
//! TLS 1.2 and 1.3 with ALPN `h2` and `http/1.1`, the handshake under a
//! deadline, the verified client's identity ([`ClientCert`]), and
//! certificate rotation.
//!
//! Rotation: [`TlsListener::watch`] reads both files every
//! [`CERT_POLL_INTERVAL`] (through any symlink, so a Kubernetes `..data`
//! swap or a file renamed into place is seen) and [`TlsListener::refresh`]
//! re-reads them on a config reload. A new pair is served from the next
//! handshake only once the certificate and the key parse and match
//! ([`judge`] says when to try); until then the old pair keeps serving and
//! the bad state is logged once. Open connections keep the session they
//! have. The client CA is read at start only.
//!
//! Nothing here prints what a key file holds.

use super::tls::{self, FileNames, Roots, TlsError};
use rustls::pki_types::CertificateDer;
use rustls::server::{ClientHello, ParsedCertificate, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::version::{TLS12, TLS13};
use rustls::ServerConfig;
use sha2::{Digest, Sha256};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How often the watcher reads the certificate and key files: a
/// cert-manager renewal or a Secret update is served within this (plus
/// kubelet's own sync delay), and two small files a second cost nothing.
pub const CERT_POLL_INTERVAL: Duration = Duration::from_secs(1);

/// What a listener serves over TLS, offered by ALPN in this order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Alpn {
    /// `h2`, then `http/1.1` (the proxy: hyper-util's auto builder serves
    /// either, and a client offering no ALPN too).
    H2AndHttp1,
    /// `http/1.1` only (the admin listener, which speaks HTTP/1).
    Http1,
}

impl Alpn {
    fn protocols(self) -> Vec<Vec<u8>> {
        match self {
            Alpn::H2AndHttp1 => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
            Alpn::Http1 => vec![b"http/1.1".to_vec()],
        }
    }
}

/// A listener's TLS settings: its files and what the user calls them
/// (`server.tls_cert_file`, ...), for errors.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ListenerTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// With it, clients must present a certificate this CA signed.
    pub client_ca: Option<PathBuf>,
    #[serde(skip)]
    pub names: FileNames,
}

/// `cert … key … [client CA …]`, as `check-config` prints it.
impl std::fmt::Display for ListenerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cert {} key {}", self.cert.display(), self.key.display())?;
        match &self.client_ca {
            Some(ca) => write!(f, ", client certificates required (CA {})", ca.display()),
            None => write!(f, ", no client certificates"),
        }
    }
}

/// A request that came over a TLS connection, in its extensions: the
/// upstream is told `X-Forwarded-Proto: https`, and with mTLS the client's
/// verified certificate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TlsSession {
    pub client: Option<ClientCert>,
}

/// The verified client certificate of an mTLS connection: the SHA-256
/// digest of its SubjectPublicKeyInfo, which survives a renewal with the
/// same key and differs per key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClientCert {
    pub spki_sha256: [u8; 32],
}

impl ClientCert {
    pub fn to_hex(&self) -> String {
        hex::encode(self.spki_sha256)
    }

    /// The identity of a certificate (DER), if it parses.
    pub fn of(cert: &CertificateDer<'_>) -> Option<Self> {
        let parsed = ParsedCertificate::try_from(cert).ok()?;
        let spki = parsed.subject_public_key_info();
        Some(Self {
            spki_sha256: Sha256::digest(spki.as_ref()).into(),
        })
    }

    /// The identity of the first certificate in a PEM file (`keys
    /// --client-cert`: the scope a client with that certificate gets).
    pub fn of_file(what: &'static str, path: &Path) -> Result<Self, TlsError> {
        let (certs, _) = tls::load_certs(what, path)?;
        Self::of(&certs[0])
            .ok_or_else(|| tls::file_error(what, path, "not a valid X.509 certificate"))
    }
}

/// Reads and checks the pair and the client CA as a listener would,
/// without serving: what `check-config` (and every config load) does.
pub fn check(tls: &ListenerTls) -> Result<(), TlsError> {
    TlsListener::new(tls.clone(), Alpn::Http1).map(drop)
}

// ===== the pair =====

/// The certificate and key files' bytes as read together; their digest
/// tells one state of the pair from another.
struct PairFiles {
    cert: Vec<u8>,
    key: Vec<u8>,
}

impl PairFiles {
    fn read(tls: &ListenerTls) -> Result<Self, TlsError> {
        let read =
            |what, path: &Path| std::fs::read(path).map_err(|e| tls::file_error(what, path, e));
        Ok(Self {
            cert: read(tls.names.cert, &tls.cert)?,
            key: read(tls.names.key, &tls.key)?,
        })
    }

    fn digest(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        // Length-prefixed: no two pairs of files share an input.
        h.update((self.cert.len() as u64).to_be_bytes());
        h.update(&self.cert);
        h.update(&self.key);
        h.finalize().into()
    }

    /// The pair as rustls serves it, if the certificate and key parse and
    /// the key is the certificate's.
    fn certified(&self, tls: &ListenerTls) -> Result<CertifiedKey, TlsError> {
        let names = tls.names;
        let certs = tls::parse_certs(names.cert, &tls.cert, &self.cert)?;
        let key = tls::parse_key(names.key, &tls.key, &self.key)?;
        let signer = tls::provider()
            .key_provider
            .load_private_key(key)
            .map_err(|e| tls::file_error(names.key, &tls.key, e))?;
        let pair = CertifiedKey::new(certs, signer);
        ParsedCertificate::try_from(&pair.cert[0])
            .map_err(|e| tls::file_error(names.cert, &tls.cert, e))?;
        match pair.keys_match() {
            Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {
                Ok(pair)
            }
            Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => {
                Err(TlsError::File {
                    what: names.key,
                    path: tls.key.clone(),
                    reason: format!(
                        "not the private key of the certificate in {} ({})",
                        tls.cert.display(),
                        names.cert
                    ),
                })
            }
            Err(e) => Err(tls::file_error(names.cert, &tls.cert, e)),
        }
    }
}

/// What a read of the files calls for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// The pair being served: nothing to do.
    Unchanged,
    /// The state already found bad and logged: keep the served pair, quietly.
    KnownBad,
    /// A new state: parse it, and serve it if it is a matching pair.
    Try,
}

/// Judges a read whose digest is `now`, given the pair `served` and the
/// last state found bad (`bad`); `asked`: a reload asked for it, which
/// tries (and reports) a bad state again.
pub fn judge(served: &[u8; 32], bad: Option<&[u8; 32]>, now: &[u8; 32], asked: bool) -> Action {
    if now == served {
        Action::Unchanged
    } else if bad == Some(now) && !asked {
        Action::KnownBad
    } else {
        Action::Try
    }
}

/// What one refresh did.
#[derive(Debug)]
pub enum Refreshed {
    Unchanged,
    /// A new pair is served from the next handshake.
    Rotated,
    /// The files are unreadable or not a matching pair: the old pair
    /// still serves.
    Kept(TlsError),
}

/// The pair being served, swapped whole by a rotation.
#[derive(Debug)]
struct Current(arc_swap::ArcSwap<CertifiedKey>);

impl ResolvesServerCert for Current {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.load_full())
    }
}

/// Digests of the state served and the last bad one, and the last read
/// failure (each logged once).
struct Seen {
    served: [u8; 32],
    bad: Option<[u8; 32]>,
    unreadable: Option<String>,
}

// ===== the listener =====

/// A listener's TLS: the acceptor and the pair it serves.
pub struct TlsListener {
    acceptor: TlsAcceptor,
    current: Arc<Current>,
    settings: ListenerTls,
    seen: Mutex<Seen>,
}

impl TlsListener {
    /// Reads the files now: a missing, unreadable or mismatched one is an
    /// error at start (naming the setting and the file).
    pub fn new(settings: ListenerTls, alpn: Alpn) -> Result<Self, TlsError> {
        let files = PairFiles::read(&settings)?;
        let pair = files.certified(&settings)?;
        let current = Arc::new(Current(arc_swap::ArcSwap::from_pointee(pair)));
        let provider = tls::provider();
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&TLS13, &TLS12])?;
        let builder = match &settings.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let roots = tls::root_store(&Roots::File(ca.clone()), settings.names.ca)?;
                let verifier = WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .build()
                    .map_err(|e| tls::file_error(settings.names.ca, ca, e))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_cert_resolver(current.clone());
        config.alpn_protocols = alpn.protocols();
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            current,
            seen: Mutex::new(Seen {
                served: files.digest(),
                bad: None,
                unreadable: None,
            }),
            settings,
        })
    }

    /// Whether clients must present a certificate.
    pub fn requires_client_cert(&self) -> bool {
        self.settings.client_ca.is_some()
    }

    /// The handshake on `stream`, within `within` (a client that stalls
    /// holds only its own task); the verified client certificate, with a
    /// client CA.
    pub async fn accept(
        &self,
        stream: TcpStream,
        within: Duration,
    ) -> io::Result<(TlsStream<TcpStream>, Option<ClientCert>)> {
        let tls = tokio::time::timeout(within, self.acceptor.accept(stream))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "TLS handshake timed out"))??;
        let client = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|chain| chain.first())
            .and_then(ClientCert::of);
        Ok((tls, client))
    }

    /// Reads the files and serves them if they are a new matching pair
    /// (see [`judge`]); `asked`: by a reload, which reports a bad state
    /// again rather than once.
    pub fn refresh(&self, asked: bool) -> Refreshed {
        let read = PairFiles::read(&self.settings);
        let mut seen = self.seen.lock().expect("not poisoned");
        let files = match read {
            Ok(f) => {
                seen.unreadable = None;
                f
            }
            // Renames and symlink swaps are atomic, so a failed read is
            // a real state (a file removed, its permissions changed):
            // logged once per failure, and on each reload.
            Err(e) => {
                let reason = e.to_string();
                if asked || seen.unreadable.as_ref() != Some(&reason) {
                    warn!(error = %e, "listener certificate files not readable; the previous pair keeps serving");
                    seen.unreadable = Some(reason);
                }
                return Refreshed::Kept(e);
            }
        };
        let now = files.digest();
        match judge(&seen.served, seen.bad.as_ref(), &now, asked) {
            Action::Unchanged => Refreshed::Unchanged,
            Action::KnownBad => Refreshed::Unchanged,
            Action::Try => match files.certified(&self.settings) {
                Ok(pair) => {
                    self.current.0.store(Arc::new(pair));
                    seen.served = now;
                    seen.bad = None;
                    info!(cert = %self.settings.cert.display(), "listener certificate rotated");
                    Refreshed::Rotated
                }
                Err(e) => {
                    seen.bad = Some(now);
                    warn!(error = %e, "new listener certificate or key not usable; the previous pair keeps serving");
                    Refreshed::Kept(e)
                }
            },
        }
    }

    /// Refreshes every [`CERT_POLL_INTERVAL`] until `stop`.
    pub async fn watch(self: Arc<Self>, stop: CancellationToken) {
        let mut tick = tokio::time::interval(CERT_POLL_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = stop.cancelled() => return,
            }
            // File reads are small and local; parsing is microseconds.
            let _ = self.refresh(false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_state_is_tried_once_and_a_bad_one_again_only_when_asked() {
        let (a, b, c) = ([1; 32], [2; 32], [3; 32]);
        use Action::*;
        for (served, bad, now, asked, want) in [
            (a, None, a, false, Unchanged),
            (a, None, a, true, Unchanged),
            (a, None, b, false, Try),
            (a, Some(b), b, false, KnownBad),
            (a, Some(b), b, true, Try),
            (a, Some(b), c, false, Try),
            // Back to the served pair after a bad state: nothing to swap.
            (a, Some(b), a, false, Unchanged),
        ] {
            assert_eq!(
                judge(&served, bad.as_ref(), &now, asked),
                want,
                "{served:?} {bad:?} {now:?} {asked}"
            );
        }
    }
}
