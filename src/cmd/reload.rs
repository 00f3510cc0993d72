//! `idemgate reload`: asks the running proxy, over its admin listener
//! (`POST /-/reload`, loopback only), to reload its config file, and says
//! how it went. For containers without a `kill` binary:
//! `kubectl exec POD -c idemgate -- idemgate reload`.
//!
//! An admin listener with `admin.tls_*` is asked over TLS, encrypted but
//! its certificate not checked: the endpoint answers loopback only, so the
//! peer is this host's own process. One that requires client certificates
//! (`admin.tls_client_ca_file`) cannot be asked: the command has none.
use crate::config::Config;
use crate::net::tls;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::process::ExitCode;
use std::time::Duration;

/// The server answers within its own 10 s bound; this adds the connect.
const TIMEOUT: Duration = Duration::from_secs(15);

/// Where to reach an admin listener bound to `listen`: a wildcard address
/// is reached on loopback (the endpoint accepts nothing else).
pub fn target(listen: SocketAddr) -> SocketAddr {
    let ip = match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, listen.port())
}

/// Exit 0 when reloaded, 1 when refused or unreachable (the message says
/// which), 64 without an admin listener to ask.
pub async fn run(cfg: &Config, admin: Option<SocketAddr>) -> ExitCode {
    let Some(listen) = admin.or(cfg.restart.admin.as_ref().map(|a| a.listen)) else {
        eprintln!("idemgate reload: the config has no [admin] listen to ask (or give --admin ADDR); send SIGHUP instead");
        return ExitCode::from(super::EX_USAGE);
    };
    let tls = cfg.restart.admin.as_ref().and_then(|a| a.tls.as_ref());
    if tls.is_some_and(|t| t.client_ca.is_some()) {
        eprintln!("idemgate reload: the admin listener requires client certificates (admin.tls_client_ca_file), which this command has none of; send SIGHUP, or POST /-/reload with a client certificate");
        return ExitCode::from(super::EX_USAGE);
    }
    let addr = target(listen);
    match tokio::time::timeout(TIMEOUT, ask(addr, tls.is_some())).await {
        Ok(Ok((status, text))) if status == StatusCode::OK => {
            outln!("{}", text.trim_end());
            ExitCode::SUCCESS
        }
        Ok(Ok((status, text))) => {
            eprintln!("idemgate reload: {} ({status})", text.trim_end());
            ExitCode::FAILURE
        }
        Ok(Err(e)) => {
            eprintln!("idemgate reload: cannot ask the admin listener at {addr}: {e}");
            ExitCode::FAILURE
        }
        Err(_) => {
            eprintln!("idemgate reload: no answer from {addr} in {TIMEOUT:?}");
            ExitCode::FAILURE
        }
    }
}

async fn ask(addr: SocketAddr, tls: bool) -> anyhow::Result<(StatusCode, String)> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    if !tls {
        return post_reload(TokioIo::new(stream), addr).await;
    }
    let names = tls::FileNames::new("admin.tls_client_ca_file", "", "");
    let mut config = tls::client_config(&tls::ClientTls {
        check: tls::ServerCheck::Nothing,
        roots: tls::Roots::System,
        identity: None,
        names,
    })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
    let stream = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(name, stream)
        .await?;
    post_reload(TokioIo::new(stream), addr).await
}

async fn post_reload<I>(io: TokioIo<I>, addr: SocketAddr) -> anyhow::Result<(StatusCode, String)>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
    tokio::spawn(conn);
    let req = Request::builder()
        .method(Method::POST)
        .uri("/-/reload")
        .header(http::header::HOST, addr.to_string())
        .body(Empty::<bytes::Bytes>::new())?;
    let resp = sender.send_request(req).await?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wildcard_listener_is_asked_on_loopback() {
        for (listen, want) in [
            ("0.0.0.0:9901", "127.0.0.1:9901"),
            ("[::]:9901", "[::1]:9901"),
            ("127.0.0.1:9901", "127.0.0.1:9901"),
            ("10.1.2.3:9901", "10.1.2.3:9901"),
        ] {
            assert_eq!(target(listen.parse().unwrap()).to_string(), want);
        }
    }
}
