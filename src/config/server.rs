//! `[server]` and `[admin]`: the listeners and the upstream.

use super::raw::{RawAdmin, RawServer};
use super::units::format_duration;
use super::upstreams::{
    check_tls, UpstreamConfig, UpstreamProtocol, UpstreamTls, DEFAULT_UPSTREAM_NAME,
};
use super::{at_least_one, dur, nonzero, Invalid};
use super::{
    DEFAULT_H2_MAX_CONCURRENT_STREAMS, DEFAULT_HEADER_READ_TIMEOUT, DEFAULT_IDLE_TIMEOUT,
    DEFAULT_LISTEN, DEFAULT_MAX_BUFFERED_BODY_BYTES, DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REQUEST_BODY_TIMEOUT, DEFAULT_SHUTDOWN_GRACE, DEFAULT_UPSTREAM_CONNECT_TIMEOUT,
    DEFAULT_UPSTREAM_POOL_IDLE_TIMEOUT, DEFAULT_UPSTREAM_POOL_MAX_IDLE, DEFAULT_UPSTREAM_TIMEOUT,
};
use crate::net::tls::FileNames;
use crate::net::tls_server::ListenerTls;
use http::Uri;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// `[server]`'s settings a reload applies: the default upstream and the
/// per-request ones. Those bound at start are [`ServerRestart`]'s.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Scheme and authority (and optional base path) of the upstream.
    pub upstream: Uri,
    pub upstream_timeout: Duration,
    pub upstream_connect_timeout: Duration,
    pub upstream_pool_idle_timeout: Duration,
    pub upstream_pool_max_idle: usize,
    /// HTTP/1.1 or HTTP/2 to the default upstream.
    pub upstream_protocol: UpstreamProtocol,
    /// `upstream_ca_file`, `upstream_cert_file`, `upstream_key_file`.
    pub upstream_tls: UpstreamTls,
    /// Time a client has to send a protected request's whole body (408).
    pub request_body_timeout: Duration,
    /// Forward the client's `Host` instead of the upstream's authority.
    pub preserve_host: bool,
    /// Keep the client's `X-Forwarded-Proto/-Host` (behind a trusted proxy).
    pub trust_forwarded_headers: bool,
}

/// `[server]`'s settings bound at start (the listener, its limits and
/// timers, shutdown, readiness): only a restart changes them. Serialized
/// only to name, field by field, those a reload would change.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ServerRestart {
    pub listen: SocketAddr,
    pub max_connections: usize,
    /// From accept to the first complete request head (also each later
    /// HTTP/1.1 head, from the end of the previous response).
    pub header_read_timeout: Duration,
    /// A connection with no request in progress is closed after this.
    pub idle_timeout: Duration,
    /// Protected request bodies buffered at once, in bytes, process-wide.
    pub max_buffered_body_bytes: u64,
    /// Streams one HTTP/2 connection may have open at once.
    pub h2_max_concurrent_streams: u32,
    pub shutdown_grace: Duration,
    /// After SIGTERM, how long readiness fails while connections are still
    /// accepted, before the drain starts.
    pub shutdown_delay: Duration,
    /// What `/readyz` reflects.
    pub readiness: Readiness,
    /// With `readiness = "upstream"`: the default upstream's path whose
    /// answer (any HTTP status) means the app listens.
    pub readiness_path: String,
    /// Reload the config file when its content changes, not only on SIGHUP.
    pub watch_config: bool,
    /// `tls_cert_file` and `tls_key_file` (and `tls_client_ca_file`):
    /// HTTPS on `listen`; none: plain HTTP. Named `server.tls_*` among
    /// the settings a reload keeps (the files' content does reload).
    /// Last, and left out when absent: `changes` lines fields up by
    /// position.
    #[serde(rename = "tls_*", skip_serializing_if = "Option::is_none")]
    pub tls: Option<ListenerTls>,
}

/// What `/readyz` answers for (`server.readiness`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Readiness {
    /// What this replica can serve: not draining, config loaded, listeners
    /// up. A store outage does not make it unready: unprotected routes and
    /// `on_store_error = "forward"` routes still work, and every replica
    /// shares the store, so failing readiness on it would take them all
    /// out of the Service at once.
    #[default]
    Serving,
    /// As `Serving`, and the store answers a ping (the behaviour before
    /// `readiness` existed).
    Store,
    /// As `Serving`, and the default upstream answers `readiness_path`
    /// with any HTTP status: a sidecar takes traffic only once its app
    /// listens.
    Upstream,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    /// `admin.tls_*`: the admin listener's own; none: plain HTTP (what
    /// kubelet probes and most scrapers expect), whatever `[server]` has.
    /// Last and left out when absent, as `ServerRestart::tls`.
    #[serde(rename = "tls_*", skip_serializing_if = "Option::is_none")]
    pub tls: Option<ListenerTls>,
}

// === listener TLS ===

const SERVER_TLS: FileNames = FileNames::new(
    "server.tls_client_ca_file",
    "server.tls_cert_file",
    "server.tls_key_file",
);
const ADMIN_TLS: FileNames = FileNames::new(
    "admin.tls_client_ca_file",
    "admin.tls_cert_file",
    "admin.tls_key_file",
);

/// A listener's TLS keys: the certificate and its key together or
/// neither; a client CA only with them. The files are read by
/// `check-config` and at start ([`crate::net::tls_server::check`]), not
/// here: a reload must not fail on a certificate mid-rotation.
fn listener_tls(
    names: FileNames,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    client_ca: Option<PathBuf>,
) -> Result<Option<ListenerTls>, Invalid> {
    match (cert, key) {
        (Some(cert), Some(key)) => Ok(Some(ListenerTls {
            cert,
            key,
            client_ca,
            names,
        })),
        // At the line of the key that is there.
        (Some(_), None) => Err(Invalid::field(
            names.cert,
            format!(
                "{} needs {} (the certificate's private key)",
                names.cert, names.key
            ),
        )),
        (None, Some(_)) => Err(Invalid::field(
            names.key,
            format!("{} needs {} (the certificate)", names.key, names.cert),
        )),
        (None, None) if client_ca.is_some() => Err(Invalid::field(
            names.ca,
            format!(
                "{} needs {} and {}: client certificates are asked for over TLS only",
                names.ca, names.cert, names.key
            ),
        )),
        (None, None) => Ok(None),
    }
}

// === impl ServerConfig ===

/// `server.readiness_path` (default `/`): a path and query, which only
/// `readiness = "upstream"` reads.
fn readiness_path(path: Option<String>) -> Result<String, Invalid> {
    match path {
        None => Ok("/".to_string()),
        Some(p) if p.starts_with('/') && p.parse::<http::uri::PathAndQuery>().is_ok() => Ok(p),
        Some(p) => Err(Invalid::field(
            "server.readiness_path",
            format!("server.readiness_path {p:?}: expected a path starting with '/'"),
        )),
    }
}

/// `[server]`, split into what reloads and what a restart changes.
pub(super) fn read(s: RawServer) -> Result<(ServerConfig, ServerRestart), Invalid> {
    let upstream = s.upstream.map(|u| u.0).ok_or_else(|| {
        Invalid::field(
            "server.upstream",
            "server.upstream is required, e.g. upstream = \"http://127.0.0.1:3000\"",
        )
    })?;
    let max_connections = at_least_one(
        "server.max_connections",
        s.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS),
    )?;
    let upstream_tls = UpstreamTls {
        ca_file: s.upstream_ca_file,
        cert_file: s.upstream_cert_file,
        key_file: s.upstream_key_file,
    };
    check_tls(&upstream, &upstream_tls, "server.upstream_")?;
    let upstream_timeout = nonzero(
        "server.upstream_timeout",
        dur(s.upstream_timeout, DEFAULT_UPSTREAM_TIMEOUT),
    )?;
    let upstream_connect_timeout = nonzero(
        "server.upstream_connect_timeout",
        dur(s.upstream_connect_timeout, DEFAULT_UPSTREAM_CONNECT_TIMEOUT),
    )?;
    let restart = ServerRestart {
        listen: s
            .listen
            .unwrap_or_else(|| DEFAULT_LISTEN.parse().expect("valid default")),
        max_connections,
        header_read_timeout: nonzero(
            "server.header_read_timeout",
            dur(s.header_read_timeout, DEFAULT_HEADER_READ_TIMEOUT),
        )?,
        idle_timeout: nonzero(
            "server.idle_timeout",
            dur(s.idle_timeout, DEFAULT_IDLE_TIMEOUT),
        )?,
        max_buffered_body_bytes: at_least_one(
            "server.max_buffered_body_bytes",
            s.max_buffered_body_bytes
                .map_or(DEFAULT_MAX_BUFFERED_BODY_BYTES, |b| b.0),
        )?,
        h2_max_concurrent_streams: at_least_one(
            "server.h2_max_concurrent_streams",
            s.h2_max_concurrent_streams
                .unwrap_or(DEFAULT_H2_MAX_CONCURRENT_STREAMS),
        )?,
        shutdown_grace: dur(s.shutdown_grace, DEFAULT_SHUTDOWN_GRACE),
        shutdown_delay: dur(s.shutdown_delay, Duration::ZERO),
        readiness: s.readiness.unwrap_or_default(),
        readiness_path: readiness_path(s.readiness_path)?,
        watch_config: s.watch_config.unwrap_or(false),
        tls: listener_tls(
            SERVER_TLS,
            s.tls_cert_file,
            s.tls_key_file,
            s.tls_client_ca_file,
        )?,
    };
    let server = ServerConfig {
        upstream,
        upstream_timeout,
        upstream_connect_timeout,
        upstream_pool_idle_timeout: dur(
            s.upstream_pool_idle_timeout,
            DEFAULT_UPSTREAM_POOL_IDLE_TIMEOUT,
        ),
        upstream_pool_max_idle: s
            .upstream_pool_max_idle
            .unwrap_or(DEFAULT_UPSTREAM_POOL_MAX_IDLE),
        upstream_protocol: s.upstream_protocol.unwrap_or_default(),
        upstream_tls,
        request_body_timeout: nonzero(
            "server.request_body_timeout",
            dur(s.request_body_timeout, DEFAULT_REQUEST_BODY_TIMEOUT),
        )?,
        preserve_host: s.preserve_host.unwrap_or(false),
        trust_forwarded_headers: s.trust_forwarded_headers.unwrap_or(false),
    };
    Ok((server, restart))
}

impl ServerConfig {
    /// The default upstream in the shape every upstream has.
    pub fn default_upstream(&self) -> UpstreamConfig {
        UpstreamConfig {
            name: DEFAULT_UPSTREAM_NAME.to_string(),
            url: self.upstream.clone(),
            timeout: self.upstream_timeout,
            connect_timeout: self.upstream_connect_timeout,
            pool_idle_timeout: self.upstream_pool_idle_timeout,
            pool_max_idle: self.upstream_pool_max_idle,
            protocol: self.upstream_protocol,
            tls: self.upstream_tls.clone(),
        }
    }
}

impl fmt::Display for ServerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let upstream = self.default_upstream();
        if upstream.protocol == UpstreamProtocol::Http1 && !upstream.is_https() {
            // As before named upstreams: check-config's output unchanged.
            return writeln!(
                f,
                "upstream   {} (timeout {}, connect {})",
                self.upstream,
                format_duration(self.upstream_timeout),
                format_duration(self.upstream_connect_timeout)
            );
        }
        writeln!(f, "upstream   {upstream}")
    }
}

// === impl AdminConfig ===

impl TryFrom<RawAdmin> for AdminConfig {
    type Error = Invalid;

    fn try_from(a: RawAdmin) -> Result<Self, Invalid> {
        let listen = a.listen.ok_or_else(|| {
            Invalid::field(
                "admin.listen",
                "admin.listen is required when [admin] is present",
            )
        })?;
        let tls = listener_tls(
            ADMIN_TLS,
            a.tls_cert_file,
            a.tls_key_file,
            a.tls_client_ca_file,
        )?;
        Ok(AdminConfig { listen, tls })
    }
}
