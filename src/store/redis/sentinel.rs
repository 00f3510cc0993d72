//! The client for the master Redis Sentinel names (`redis.sentinels`):
//! which sentinels to ask, with which credentials and TLS. Following that
//! master across failovers, and its epoch, is `master.rs`'s.
//!
//! The redis crate's [`SentinelClient`] asks the sentinels for the
//! master's address and checks that the server there says `ROLE master`,
//! but hands back one plain connection that never asks again: the
//! [`Follower`] drops it on every connection-level failure and asks anew.

use super::master::{Follower, Source};
use crate::config::{RedisConfig, SentinelConfig};
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{ConnectionAddr, RedisResult, TlsCertificates, TlsMode};

/// Follows the master `sentinel` names, without connecting.
pub(crate) fn follower(
    cfg: &RedisConfig,
    sentinel: &SentinelConfig,
    certs: Option<TlsCertificates>,
) -> RedisResult<Follower> {
    let addrs = sentinel.sentinels.iter().map(|(host, port)| {
        if sentinel.tls {
            ConnectionAddr::TcpTls {
                host: host.clone(),
                port: *port,
                insecure: false,
                tls_params: None,
            }
        } else {
            ConnectionAddr::Tcp(host.clone(), *port)
        }
    });
    let mut builder =
        SentinelClientBuilder::new(addrs, &sentinel.master, SentinelServerType::Master)?;
    if let Some(user) = &sentinel.username {
        builder = builder.set_client_to_redis_username(user);
    }
    if let Some(password) = &sentinel.password {
        builder = builder.set_client_to_redis_password(password);
    }
    if let Some(user) = &sentinel.sentinel_username {
        builder = builder.set_client_to_sentinel_username(user);
    }
    if let Some(password) = &sentinel.sentinel_password {
        builder = builder.set_client_to_sentinel_password(password);
    }
    if sentinel.tls {
        builder = builder
            .set_client_to_redis_tls_mode(TlsMode::Secure)
            .set_client_to_sentinel_tls_mode(TlsMode::Secure);
        if let Some(certs) = certs {
            builder = builder
                .set_client_to_redis_certificates(certs.clone())
                .set_client_to_sentinel_certificates(certs);
        }
    }
    // Each sentinel is tried in turn, then the master is connected to
    // and asked twice (ROLE, INFO).
    let bound = cfg.timeout * (sentinel.sentinels.len() as u32 + 3);
    let client: SentinelClient = builder.build()?;
    Ok(Follower::new(Source::Sentinel(client), cfg.timeout, bound))
}
