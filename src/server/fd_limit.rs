//! The file-descriptor limit (`RLIMIT_NOFILE`) reconciled with
//! `server.max_connections`. Services are often started with a soft limit
//! of 1024 (systemd, container runtimes) and a much higher hard one; at
//! 1024 a thousand idle clients leave no descriptor for an upstream
//! connect (EMFILE: 502). At start-up `serve` raises the soft limit to the
//! hard one (as nginx and Go do); if that still cannot hold
//! `max_connections` with the sockets they need and the process's own
//! ([`reserved`]), the effective connection limit (and the tunnel limit,
//! the same number) is lowered, and the log and `check-config` say so.

use crate::config::{Backend, Config};
use std::fmt;

/// Descriptors one connection slot may need: the client socket and the
/// upstream socket of its request in flight, and as much again for a tunnel
/// slot (an upgraded connection leaves the connection limit for the tunnel
/// limit, which is the same number, and holds both its sockets).
pub const PER_CONNECTION: u64 = 4;

/// Files and runtime descriptors: stdio, epoll, the runtime's wakers and
/// signal pipes, config reads, the SQLite files, `/proc` reads for metrics.
const RESERVE_FILES: u64 = 64;
/// Admin connections (`/metrics`, probes): the admin listener's limit.
const ADMIN_CONNECTIONS: u64 = crate::server::ADMIN_MAX_CONNECTIONS as u64;
/// A PostgreSQL store's connections beyond its pool: the LISTEN connection
/// of waiting routes and the migration lock's.
const POSTGRES_EXTRA: u64 = 2;
/// Redis: one multiplexed connection; a cluster one per node (a reserve).
const REDIS_SINGLE: u64 = 2;
const REDIS_CLUSTER: u64 = 32;
/// The OTLP exporter's connections.
const TRACING: u64 = 2;

/// Descriptors the process needs apart from its connection slots,
/// estimated from the config: the listeners, the upstreams' idle pools,
/// the store's pool, Redis, the admin listener's connections, tracing and
/// a reserve for files.
pub fn reserved(config: &Config) -> u64 {
    let idle_pools: u64 = std::iter::once(config.server.upstream_pool_max_idle)
        .chain(config.upstreams.values().map(|u| u.pool_max_idle))
        .map(|n| n as u64)
        .sum();
    let restart = &config.restart;
    let store = match restart.store.backend {
        Backend::Postgres => restart.store.pool_size as u64 + POSTGRES_EXTRA,
        Backend::Sqlite | Backend::Memory => 0,
    };
    let redis = match &restart.redis {
        Some(r) if r.cluster => REDIS_CLUSTER,
        Some(_) => REDIS_SINGLE,
        None => 0,
    };
    let admin = restart.admin.as_ref().map_or(0, |_| 1 + ADMIN_CONNECTIONS);
    let tracing = restart.tracing.as_ref().map_or(0, |_| TRACING);
    RESERVE_FILES + 1 + admin + idle_pools + store + redis + tracing
}

/// The connection limit `limit` descriptors can hold: `configured`, or
/// fewer when the slots and `reserved` do not fit (at least one).
pub fn effective_connections(limit: u64, reserved: u64, configured: usize) -> usize {
    let fits = limit.saturating_sub(reserved) / PER_CONNECTION;
    usize::try_from(fits)
        .unwrap_or(usize::MAX)
        .clamp(1, configured.max(1))
}

/// What the limits are and what follows for `max_connections`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FdPlan {
    /// The soft limit found at start.
    pub soft: u64,
    pub hard: u64,
    /// The soft limit the process runs with (raised to `hard` if it could).
    pub raised: u64,
    pub reserved: u64,
    pub configured: usize,
    pub effective: usize,
}

impl FdPlan {
    /// The plan for `config` under the limits `soft` / `hard`, the soft one
    /// raised to `raised`.
    pub fn new(config: &Config, soft: u64, hard: u64, raised: u64) -> Self {
        let reserved = reserved(config);
        let configured = config.restart.server.max_connections;
        Self {
            soft,
            hard,
            raised,
            reserved,
            configured,
            effective: effective_connections(raised, reserved, configured),
        }
    }

    pub fn lowered(&self) -> bool {
        self.effective < self.configured
    }

    /// Descriptors `configured` connections would need.
    pub fn needed(&self) -> u64 {
        self.configured as u64 * PER_CONNECTION + self.reserved
    }
}

impl fmt::Display for FdPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.lowered() {
            write!(
                f,
                "the file-descriptor limit ({}, hard {}) cannot hold server.max_connections = {}: that needs {} ({} per connection and tunnel slot, {} for the upstream pools, store, admin and files); max_connections is lowered to {}. Raise the hard limit (LimitNOFILE= in systemd, --ulimit nofile= in Docker) to at least {}",
                self.raised,
                self.hard,
                self.configured,
                self.needed(),
                PER_CONNECTION,
                self.reserved,
                self.effective,
                self.needed()
            )
        } else {
            write!(
                f,
                "file-descriptor limit {} (hard {}) holds server.max_connections = {} (needs {})",
                self.raised,
                self.hard,
                self.configured,
                self.needed()
            )
        }
    }
}

/// The process's `RLIMIT_NOFILE` (soft, hard).
pub fn current() -> std::io::Result<(u64, u64)> {
    rlimit::getrlimit(rlimit::Resource::NOFILE)
}

/// `serve`: raises the soft limit to the hard one and plans
/// `max_connections` under it (the server runs with
/// [`FdPlan::effective`]; the config keeps the file's value, which reloads
/// compare against).
pub fn reconcile(config: &Config) -> std::io::Result<FdPlan> {
    let (soft, hard) = current()?;
    // To the hard limit (on macOS also kern.maxfilesperproc).
    let raised = rlimit::increase_nofile_limit(u64::MAX)?;
    Ok(FdPlan::new(config, soft, hard, raised))
}

/// `check-config`: what `serve` would do under this process's limits.
pub fn preview(config: &Config) -> std::io::Result<FdPlan> {
    let (soft, hard) = current()?;
    Ok(FdPlan::new(config, soft, hard, soft.max(hard)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn effective_connections_table() {
        // (limit, reserved, configured) -> effective
        let cases: [(u64, u64, usize, usize); 8] = [
            // Plenty: the configured limit.
            (1_048_576, 200, 10_000, 10_000),
            // Exactly enough.
            (40_200, 200, 10_000, 10_000),
            // One descriptor short: one slot fewer.
            (40_199, 200, 10_000, 9_999),
            // The hard limit.
            (20_000, 200, 10_000, 4_950),
            // A soft limit of 1024 left alone (hard 1024).
            (1024, 145, 10_000, 219),
            // Reserved alone eats the limit: still one slot.
            (100, 145, 10_000, 1),
            (0, 0, 10, 1),
            // A configured limit below what fits is kept.
            (1_048_576, 145, 4, 4),
        ];
        for (limit, reserved, configured, want) in cases {
            assert_eq!(
                effective_connections(limit, reserved, configured),
                want,
                "limit {limit}, reserved {reserved}, configured {configured}"
            );
        }
    }

    fn config(extra: &str) -> Config {
        let text = format!("[server]\nupstream = \"http://127.0.0.1:3000\"\n{extra}");
        Config::parse(&text, "t.toml").expect("config")
    }

    #[test]
    fn reserved_counts_pools_store_redis_admin_and_files() {
        // Defaults: SQLite, one upstream pool of 64, no admin.
        let base = RESERVE_FILES + 1 + 64;
        let cases: [(&str, u64); 4] = [
            ("", base),
            (
                "upstream_pool_max_idle = 10\n[upstreams.b]\nurl = \"http://b:1\"\npool_max_idle = 5\n",
                RESERVE_FILES + 1 + 15,
            ),
            (
                "[admin]\nlisten = \"127.0.0.1:9000\"\n[store]\nbackend = \"postgres\"\nurl = \"postgres://x/y\"\npool_size = 16\n[redis]\nurl = \"redis://r\"\n",
                base + 1 + ADMIN_CONNECTIONS + 16 + POSTGRES_EXTRA + REDIS_SINGLE,
            ),
            ("[store]\nbackend = \"memory\"\n", base),
        ];
        for (extra, want) in cases {
            assert_eq!(reserved(&config(extra)), want, "{extra}");
        }
    }

    #[test]
    fn a_plan_says_when_it_lowers_and_how_far() {
        let cfg = config("max_connections = 10000\n");
        let plan = FdPlan::new(&cfg, 1024, 20_000, 20_000);
        assert!(plan.lowered());
        assert_eq!(plan.effective, (20_000 - plan.reserved as usize) / 4);
        let text = plan.to_string();
        assert!(text.contains("max_connections is lowered to"), "{text}");
        assert!(text.contains(&plan.needed().to_string()), "{text}");
        let roomy = FdPlan::new(&cfg, 1024, 1 << 20, 1 << 20);
        assert!(!roomy.lowered());
        assert!(roomy.to_string().contains("holds"), "{roomy}");
    }
}
