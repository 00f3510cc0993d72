//! The invariant harness (issue 8, "Proof"): mixed traffic through three
//! real `idemgate serve` replicas, sharing one PostgreSQL schema and one
//! Redis prefix, to a recording upstream on loopback, while one fault at a
//! time is injected; then `support::checker` judges every key: at most one
//! execution except after a documented release, every replay identical to
//! its original, nothing across scopes, every request answered or given a
//! documented error.
//!
//! Message consumers (issue 24) have runs of their own, one per broker:
//! two replicas on PostgreSQL consume one queue (or durable) of a private
//! broker, one is SIGKILLed holding deliveries and the broker is restarted
//! mid-run; `support::checker::consumer` judges what was published,
//! executed, dead-lettered and left behind by the same model of releases.
//!
//! Each CI test injects its fault once, in the middle of a few seconds of
//! load, and prints its invariant report. [`soak`] (ignored by default;
//! `scripts/soak.sh [SECONDS]`) runs every fault for longer, injecting it
//! repeatedly, and prints the report for all of them.
//!
//! Every random choice (the traffic's operations, the upstream's
//! behaviours, the relay's refusals) comes from one seed
//! (`support::seed`): `IDEMGATE_TEST_SEED=<n>` sets it, else it is drawn at
//! random; each run prints it first and with its report, and a failure's
//! message says how to replay it, e.g.
//! `IDEMGATE_TEST_SEED=<n> cargo test --test it invariants_hold_without_faults`.

use crate::support::brokers::{
    rabbitmq_counts_on, PrivateNats, PrivateRabbit, TestQueue, TestStream,
};
use crate::support::checker::consumer::{check_consumer, ConsumerReport, ConsumerTrace, Published};
use crate::support::checker::{check, lost_answers, Event, EventKind, Report, Trace};
use crate::support::pg_cluster::PgCluster;
use crate::support::recording_upstream::{Kind, Mix, RecordingUpstream};
use crate::support::redis_sentinel::{SentinelSet, MASTER_NAME};
use crate::support::seed::Seed;
use crate::support::services::{
    database_url, postgres_addr, require_postgres, PrivateRedis, TcpRelay,
};
use crate::support::traffic::{Call, Phase, Seen, Traffic};
use crate::support::{
    database_url_via, Route, ServeProcess, TestConfig, TestSchema, DEADLINE, ORDERS,
};
use bytes::Bytes;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

const REPLICAS: usize = 3;
const WORKERS: usize = 6;
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(1);
/// Under clock skew requests must outlive the lease, as in the incident.
const SKEW_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);
/// Long enough for every in-flight request to finish (the slowest upstream
/// answer is twice the upstream timeout of the faults that stop replicas).
const SHUTDOWN_GRACE: &str = "5s";
/// Lease under most faults; under clock skew it is 1 s, shorter than the skew.
const LEASE: Duration = Duration::from_secs(2);
const SKEW_LEASE: Duration = Duration::from_secs(1);
/// The skewed replica's clock offset: more than a lease ahead.
const SKEW_MS: i64 = 3000;

/// CI: this much load, the fault injected once at `INJECT_AT` and undone
/// `HOLD` later (longer than a lease: a real outage).
const CI_LOAD: Duration = Duration::from_secs(5);
const INJECT_AT: Duration = Duration::from_secs(1);
const HOLD: Duration = Duration::from_millis(2500);
/// Soak: the fault is injected again every `SOAK_PERIOD`.
const SOAK_PERIOD: Duration = Duration::from_secs(6);
/// Soak length when `IDEMGATE_SOAK_SECS` is not set.
const DEFAULT_SOAK_SECS: u64 = 300;

/// One fault at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    None,
    ReplicaKilled,
    ReplicaTerminated,
    RedisRestarted,
    RedisFrozen,
    PostgresCut,
    ClockSkew,
    UpstreamSlow,
    UpstreamResets,
    ClientsDisconnect,
    UpstreamNotExecuted,
    ConfigRewritten,
}

const ALL_FAULTS: [Fault; 12] = [
    Fault::None,
    Fault::ReplicaKilled,
    Fault::ReplicaTerminated,
    Fault::RedisRestarted,
    Fault::RedisFrozen,
    Fault::PostgresCut,
    Fault::ClockSkew,
    Fault::UpstreamSlow,
    Fault::UpstreamResets,
    Fault::ClientsDisconnect,
    Fault::UpstreamNotExecuted,
    Fault::ConfigRewritten,
];

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::None => "none",
            Fault::ReplicaKilled => "replica SIGKILL",
            Fault::ReplicaTerminated => "replica SIGTERM",
            Fault::RedisRestarted => "redis killed+restarted",
            Fault::RedisFrozen => "redis SIGSTOP+SIGCONT",
            Fault::PostgresCut => "postgres cut+restored",
            Fault::ClockSkew => "clock skew +3s",
            Fault::UpstreamSlow => "upstream beyond timeout",
            Fault::UpstreamResets => "upstream resets",
            Fault::ClientsDisconnect => "clients disconnect",
            Fault::UpstreamNotExecuted => "upstream 408/425/429",
            Fault::ConfigRewritten => "config rewritten under watch_config",
        }
    }

    fn lease(self) -> Duration {
        if self == Fault::ClockSkew {
            SKEW_LEASE
        } else {
            LEASE
        }
    }

    /// Slow answers are measured against it.
    fn upstream_timeout(self) -> Duration {
        if self == Fault::ClockSkew {
            SKEW_UPSTREAM_TIMEOUT
        } else {
            UPSTREAM_TIMEOUT
        }
    }

    fn mix(self) -> Mix {
        match self {
            Fault::UpstreamSlow => Mix::base().with(Kind::SlowBeyondTimeout, 25),
            Fault::UpstreamResets => Mix::base()
                .with(Kind::ResetMidBody, 15)
                .with(Kind::ResetBeforeHead, 8),
            Fault::UpstreamNotExecuted => Mix::base().with(Kind::NotExecuted, 12),
            _ => Mix::base(),
        }
    }

    /// Every fault runs with the Redis fast path except clock skew: Redis
    /// locks expire by relative time and would hide what the skew does to
    /// PostgreSQL, which is the guard (Redis is never the only one).
    fn uses_redis(self) -> bool {
        self != Fault::ClockSkew
    }

    /// Whether it is injected and undone (rather than there all along).
    fn is_cyclic(self) -> bool {
        matches!(
            self,
            Fault::ReplicaKilled
                | Fault::ReplicaTerminated
                | Fault::RedisRestarted
                | Fault::RedisFrozen
                | Fault::PostgresCut
                | Fault::ConfigRewritten
        )
    }
}

// ===== the cluster =====

/// One replica's addresses and, while it runs, its process.
struct Replica {
    index: usize,
    listen: SocketAddr,
    admin: SocketAddr,
    env: Vec<(&'static str, String)>,
    process: Option<ServeProcess>,
    starts: usize,
}

impl Replica {
    /// Starts (or restarts) it on its ports, with a config file per start
    /// so every run's log is kept.
    async fn start(&mut self, config: &TestConfig, dir: &Path) {
        let path = dir.join(format!("replica-{}-{}.toml", self.index, self.starts));
        config.clone().listen(self.listen, self.admin).write(&path);
        let env: Vec<(&str, &str)> = self.env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        self.process = Some(ServeProcess::start(&path, self.listen, self.admin, &env).await);
        self.starts += 1;
    }

    fn running(&mut self) -> &mut ServeProcess {
        self.process.as_mut().expect("the replica is running")
    }
}

/// The replicas and the services under them. Field order matters: the
/// processes stop before Redis, the relay and the schema go.
struct Cluster {
    replicas: Vec<Replica>,
    redis: Option<PrivateRedis>,
    relay: Option<TcpRelay>,
    config: TestConfig,
    dir: tempfile::TempDir,
    _schema: TestSchema,
}

impl Cluster {
    async fn start(fault: Fault, upstream: SocketAddr) -> Self {
        Self::start_with(fault, upstream, |c| c).await
    }

    /// [`Cluster::start`] with `tweak` applied to the replicas' config.
    async fn start_with(
        fault: Fault,
        upstream: SocketAddr,
        tweak: impl FnOnce(TestConfig) -> TestConfig,
    ) -> Self {
        let db = database_url();
        require_postgres(&db).await;
        let relay = match fault {
            Fault::PostgresCut => Some(TcpRelay::start(postgres_addr()).await),
            _ => None,
        };
        let store_url = relay.as_ref().map_or(db, |r| database_url_via(r.addr()));
        Self::start_on(fault, upstream, store_url, relay, fault.uses_redis(), tweak).await
    }

    /// [`Cluster::start_with`] on the PostgreSQL at `store_url` (through
    /// `relay`, if any), with or without Redis.
    async fn start_on(
        fault: Fault,
        upstream: SocketAddr,
        store_url: String,
        relay: Option<TcpRelay>,
        with_redis: bool,
        tweak: impl FnOnce(TestConfig) -> TestConfig,
    ) -> Self {
        let redis = with_redis.then(PrivateRedis::start);
        let schema = TestSchema::new();
        let mut config = TestConfig::new(upstream)
            .set(
                "server.upstream_timeout",
                format!("{}ms", fault.upstream_timeout().as_millis()),
            )
            .set("server.shutdown_grace", SHUTDOWN_GRACE)
            .set("store.backend", "postgres")
            .set("store.url", store_url)
            .set("store.schema", schema.schema.as_str())
            .set("store.pool_size", 4)
            .set("store.connect_timeout", "1s")
            .set("store.timeout", "1s")
            .route(Route::post(ORDERS).set("lease", format!("{}ms", fault.lease().as_millis())));
        if fault == Fault::ConfigRewritten {
            config = config.set("server.watch_config", true);
        }
        if let Some(redis) = &redis {
            config = config
                .set("redis.url", redis.url())
                .set("redis.prefix", schema.prefix.as_str())
                .set("redis.timeout", "250ms");
        }
        let config = tweak(config);
        let dir = tempfile::TempDir::new().expect("tempdir");
        let mut replicas: Vec<Replica> = (0..REPLICAS)
            .map(|index| Replica {
                index,
                listen: crate::support::free_port(),
                admin: crate::support::free_port(),
                // The last replica's clock runs ahead by more than a lease.
                env: if fault == Fault::ClockSkew && index == REPLICAS - 1 {
                    vec![(idemgate::clock::TEST_OFFSET_ENV, SKEW_MS.to_string())]
                } else {
                    Vec::new()
                },
                process: None,
                starts: 0,
            })
            .collect();
        futures_util::future::join_all(replicas.iter_mut().map(|r| r.start(&config, dir.path())))
            .await;
        Self {
            replicas,
            redis,
            relay,
            config,
            dir,
            _schema: schema,
        }
    }

    fn redis(&mut self) -> &mut PrivateRedis {
        self.redis.as_mut().expect("this fault runs with Redis")
    }

    fn addrs(&self) -> Vec<SocketAddr> {
        self.replicas.iter().map(|r| r.listen).collect()
    }

    /// Injects `fault` (the `round`-th time); returns what happened.
    async fn inject(&mut self, fault: Fault, round: usize) -> Option<EventKind> {
        let victim = (1 + round) % REPLICAS;
        let kind = match fault {
            Fault::ReplicaKilled => {
                self.replicas[victim].running().kill();
                EventKind::Killed(victim)
            }
            Fault::ReplicaTerminated => {
                self.replicas[victim].running().terminate();
                EventKind::Terminated(victim)
            }
            Fault::RedisRestarted => {
                self.redis().kill();
                EventKind::RedisKilled
            }
            Fault::RedisFrozen => {
                self.redis().pause();
                EventKind::RedisFrozen
            }
            Fault::PostgresCut => {
                self.relay.as_ref().expect("relay").cut();
                EventKind::PostgresCut
            }
            // Nothing a rewrite does excuses a violation: no event.
            Fault::ConfigRewritten => {
                self.rewrite_configs(round).await;
                return None;
            }
            _ => return None,
        };
        Some(kind)
    }

    /// Undoes the `round`-th injection.
    async fn recover(&mut self, fault: Fault, round: usize) -> Option<EventKind> {
        let victim = (1 + round) % REPLICAS;
        let kind = match fault {
            Fault::ReplicaKilled | Fault::ReplicaTerminated => {
                let replica = &mut self.replicas[victim];
                if fault == Fault::ReplicaTerminated {
                    let code = replica.running().exited().await;
                    assert_eq!(code, Some(0), "a SIGTERMed replica exits cleanly");
                }
                replica.process = None;
                replica.start(&self.config, self.dir.path()).await;
                EventKind::Restarted(victim)
            }
            Fault::RedisRestarted => {
                self.redis().restart();
                EventKind::RedisRestarted
            }
            Fault::RedisFrozen => {
                self.redis().resume();
                EventKind::RedisResumed
            }
            Fault::PostgresCut => {
                self.relay.as_ref().expect("relay").restore();
                EventKind::PostgresRestored
            }
            Fault::ConfigRewritten => {
                self.rename_configs(round).await;
                return None;
            }
            _ => return None,
        };
        Some(kind)
    }

    /// The file replica `i` watches: the one its last start wrote.
    fn config_path(&self, i: usize) -> std::path::PathBuf {
        let r = &self.replicas[i];
        self.dir
            .path()
            .join(format!("replica-{}-{}.toml", r.index, r.starts - 1))
    }

    /// Replica `i`'s config as version `v` (a reloadable setting differs
    /// per version), with the route last, split where a writer's first
    /// write would leave a valid config without the protected route.
    fn config_version(&self, i: usize, v: usize) -> (String, String) {
        let r = &self.replicas[i];
        let text = self
            .config
            .clone()
            .listen(r.listen, r.admin)
            .set("server.request_body_timeout", format!("{}s", 30 + v))
            .render();
        let mut table: toml::Table = text.parse().expect("the config parses");
        let route = table.remove("route").expect("a route");
        let mut routes = toml::Table::new();
        routes.insert("route".into(), route);
        (
            toml::to_string(&table).expect("renders"),
            format!("\n{}", toml::to_string(&routes).expect("renders")),
        )
    }

    /// Config rewrites under `watch_config`, the `round`-th time, all at
    /// once: replica 0's file in place in two writes 1.9 s apart (the
    /// first a valid config without the route), replica 1's in place in
    /// small writes 0.45 s apart (one of them ending where the route
    /// starts), replica 2's by renaming a complete file over it.
    async fn rewrite_configs(&self, round: usize) {
        use std::io::Write;
        let version = 2 * round + 1;
        let in_place = |i: usize, pieces: Vec<String>, gap: Duration| {
            let path = self.config_path(i);
            async move {
                let mut file = std::fs::OpenOptions::new()
                    .write(true)
                    .truncate(true)
                    .open(&path)
                    .expect("open the config in place");
                for (n, piece) in pieces.iter().enumerate() {
                    if n > 0 {
                        tokio::time::sleep(gap).await;
                    }
                    file.write_all(piece.as_bytes()).expect("write");
                    file.flush().expect("flush");
                }
            }
        };
        let (head, route) = self.config_version(0, version);
        let halves = in_place(0, vec![head, route], Duration::from_millis(1900));
        let (head, route) = self.config_version(1, version);
        let (a, b) = head.split_at(head.len() / 3);
        let (r1, r2) = route.split_at(route.len() / 2);
        let pieces = [a, b, r1, r2].map(str::to_string).to_vec();
        let small = in_place(1, pieces, Duration::from_millis(450));
        let renamed = async { self.rename_config(2, version) };
        futures_util::future::join3(halves, small, renamed).await;
    }

    /// Every file renamed over by a complete version (the fault undone).
    async fn rename_configs(&self, round: usize) {
        for i in 0..REPLICAS {
            self.rename_config(i, 2 * round + 2);
        }
    }

    /// `mv tmp <config>`: a complete file takes the name at once.
    fn rename_config(&self, i: usize, version: usize) {
        let path = self.config_path(i);
        let tmp = path.with_extension("toml.tmp");
        let (head, route) = self.config_version(i, version);
        std::fs::write(&tmp, head + &route).expect("write the new config");
        std::fs::rename(&tmp, &path).expect("rename it over the config");
    }

    /// The last lines of every replica's log, for a failed run.
    fn log_tails(&self) -> String {
        log_tails(self.dir.path())
    }
}

/// The last lines of every replica's log in `dir`, for a failed run.
fn log_tails(dir: &Path) -> String {
    let mut out = String::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "stderr") {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(15)..];
            out.push_str(&format!(
                "--- {} ---\n{}\n",
                path.file_name().unwrap_or_default().to_string_lossy(),
                tail.join("\n")
            ));
        }
    }
    out
}

// ===== one run =====

/// When the fault is injected: once (CI) or every [`SOAK_PERIOD`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Schedule {
    Once,
    Repeated,
}

/// Drives `load` of traffic under `fault`, sweeps every key once more, and
/// checks the invariants. Prints the report (and replica logs on a
/// violation).
async fn run(fault: Fault, load: Duration, schedule: Schedule) -> Report {
    let t0 = Instant::now();
    let seed = seed_for(fault.name());
    let up = RecordingUpstream::start(fault.mix(), fault.upstream_timeout(), seed).await;
    let mut cluster = Cluster::start(fault, up.addr).await;
    let drops = fault == Fault::ClientsDisconnect;
    let traffic = Traffic::new(cluster.addrs(), drops, seed);
    let started = Instant::now();
    let load_task = tokio::spawn(traffic.clone().run(WORKERS, load));

    let mut events = Vec::new();
    if fault.is_cyclic() {
        let mut round = 0;
        let mut at = INJECT_AT;
        while at + HOLD < load {
            tokio::time::sleep_until((started + at).into()).await;
            // Stamped before the signal: its effects may be seen at once.
            let injected = Instant::now();
            let kind = cluster.inject(fault, round).await;
            events.extend(kind.map(|kind| Event { at: injected, kind }));
            tokio::time::sleep_until((started + at + HOLD).into()).await;
            // Stamped once it is back (a restarted replica accepts).
            let kind = cluster.recover(fault, round).await;
            events.extend(kind.map(|kind| Event {
                at: Instant::now(),
                kind,
            }));
            round += 1;
            at += SOAK_PERIOD;
            if schedule == Schedule::Once {
                break;
            }
        }
    }
    judge(
        fault,
        fault.name(),
        t0,
        &up,
        &cluster,
        &traffic,
        load_task,
        events,
        load,
    )
    .await
}

/// The end of a run: waits for `load_task`, sweeps every key once more,
/// and checks the invariants over everything recorded since `t0`. Prints
/// the report (and replica logs on a violation) under `name`.
#[allow(clippy::too_many_arguments)]
async fn judge(
    fault: Fault,
    name: &'static str,
    t0: Instant,
    up: &RecordingUpstream,
    cluster: &Cluster,
    traffic: &Arc<Traffic>,
    load_task: tokio::task::JoinHandle<()>,
    events: Vec<Event>,
    load: Duration,
) -> Report {
    tokio::time::timeout(load + DEADLINE, load_task)
        .await
        .expect("the load ends")
        .expect("traffic task");
    up.settle(Duration::from_millis(300), DEADLINE).await;

    sweep_every_key(traffic, up, fault.lease()).await;

    let report = check(&Trace {
        fault: name,
        t0,
        executions: up.executions(),
        observations: traffic.observations(),
        events,
        upstream_timeout: fault.upstream_timeout(),
        lease: fault.lease(),
    });
    println!("{report}{}", replay());
    if !report.violations.is_empty() {
        println!("replica logs (tails):\n{}", cluster.log_tails());
    }
    report
}

/// The generators' seed for the run `name`, printed first: a run that
/// fails in any way shows how to replay it.
fn seed_for(name: &str) -> Seed {
    println!("{name}: {}", replay());
    Seed::get().derive(name)
}

/// How to replay this process's runs.
fn replay() -> String {
    let seed = Seed::get();
    format!("random choices from {seed}; replay with `{seed} cargo test --test it <test name>`")
}

/// Every key once more, as its latest execution's request: it replays,
/// is 410, or (if released) runs again. A key the load left unsettled
/// first gets a different request under it (422, or a run if released).
async fn sweep_every_key(
    traffic: &std::sync::Arc<Traffic>,
    up: &RecordingUpstream,
    lease: Duration,
) {
    let groups = sweep_groups(traffic, up);
    let patience = lease * 2 + Duration::from_secs(3);
    traffic
        .clone()
        .sweep(groups, (0..REPLICAS).collect(), patience)
        .await;
    up.settle(Duration::from_millis(300), DEADLINE).await;
}

/// Per key used under load: the request of its latest execution (or,
/// never executed, its last request), preceded by a different request
/// where the load left the key unsettled (its last answer was not final).
fn sweep_groups(traffic: &Traffic, up: &RecordingUpstream) -> Vec<Vec<Call>> {
    let mut last: BTreeMap<(Option<String>, String), (Call, bool)> = BTreeMap::new();
    for o in traffic.observations() {
        if o.phase == Phase::Load {
            let settled = match &o.seen {
                Seen::Response(r) => !matches!(r.status(), 409 | 408 | 425 | 429 | 500..=599),
                Seen::Transport(_) | Seen::Dropped | Seen::Hung => false,
            };
            let call = Call {
                scope: o.scope,
                key: o.key.clone(),
                body: o.body.clone(),
            };
            last.insert((o.scope.map(str::to_string), o.key), (call, settled));
        }
    }
    for e in up.executions() {
        if let Some((call, _)) = e.key.and_then(|key| last.get_mut(&(e.scope.clone(), key))) {
            call.body = e.body;
        }
    }
    last.into_values()
        .map(|(call, settled)| {
            let mut group = Vec::new();
            if !settled {
                let mut other = call.clone();
                other.body = Bytes::from(format!("{{\"sweep\":{:?}}}", call.key));
                group.push(other);
            }
            group.push(call);
            group
        })
        .collect()
}

async fn holds(fault: Fault) {
    let report = run(fault, CI_LOAD, Schedule::Once).await;
    assert!(
        report.violations.is_empty(),
        "{} invariant violation(s) under {:?}; see the report above; {}",
        report.violations.len(),
        fault,
        replay()
    );
}

// ===== one test per fault =====

/// One `#[tokio::test]` per `name => Fault`, each running [`holds`];
/// attributes (an `#[ignore]` naming a known defect) go before the name.
macro_rules! fault_tests {
    ($($(#[$attr:meta])* $name:ident => $fault:ident,)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        $(#[$attr])*
        async fn $name() {
            holds(Fault::$fault).await;
        }
    )*};
}

fault_tests! {
    invariants_hold_without_faults => None,
    invariants_hold_when_a_replica_is_sigkilled_under_load => ReplicaKilled,
    invariants_hold_when_a_replica_is_sigtermed_under_load => ReplicaTerminated,
    invariants_hold_when_redis_is_killed_and_restarted => RedisRestarted,
    invariants_hold_when_redis_is_frozen_and_resumed => RedisFrozen,
    invariants_hold_when_postgres_connections_are_cut_and_restored => PostgresCut,
    invariants_hold_when_replica_clocks_disagree_by_more_than_a_lease => ClockSkew,
    invariants_hold_when_the_upstream_is_slower_than_its_timeout => UpstreamSlow,
    invariants_hold_when_the_upstream_resets_mid_response => UpstreamResets,
    invariants_hold_when_clients_disconnect_mid_request => ClientsDisconnect,
    invariants_hold_when_the_upstream_answers_408_425_429 => UpstreamNotExecuted,
    invariants_hold_when_the_watched_config_is_rewritten_in_place_and_renamed => ConfigRewritten,
}

/// The checker has no kind of its own for a crash or a failover: to it, as
/// to the replicas, the database was unreachable from `crashed` to now.
fn outage_since(crashed: Instant) -> Vec<Event> {
    vec![
        Event {
            at: crashed,
            kind: EventKind::PostgresCut,
        },
        Event {
            at: Instant::now(),
            kind: EventKind::PostgresRestored,
        },
    ]
}

// ===== a PostgreSQL crash with lazy commits =====

/// A server whose default acknowledges commits before their WAL is flushed,
/// and whose WAL writer waits 10 s before writing them out: a crash loses
/// every commit of the last seconds that was not made durable.
const LAZY_COMMITS: &str = "synchronous_commit = off\nwal_writer_delay = 10s\n";

/// The replicas on a private PostgreSQL with [`LAZY_COMMITS`] (no Redis:
/// PostgreSQL alone is the guard), which crashes (SIGKILL to every
/// process of it, [`PgCluster::kill`]) under load and is started again at once (crash recovery):
/// no key may run twice, i.e. nothing idemgate acted on may have been only
/// in the WAL buffers. The outage stays shorter than a lease, so this
/// checks durability, not what an outage longer than a lease does to a
/// completion still waiting for the store (the lease runs out; see
/// `Fault::PostgresCut` for an outage).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariants_hold_when_a_synchronous_commit_off_postgres_crashes_under_load() {
    let fault = Fault::None;
    let t0 = Instant::now();
    let name = "postgres crash (sync off)";
    let seed = seed_for(name);
    let up = RecordingUpstream::start(fault.mix(), fault.upstream_timeout(), seed).await;
    let mut pg = PgCluster::private(LAZY_COMMITS);
    let url = pg.url("postgres", "127.0.0.1", "sslmode=disable");
    let cluster = Cluster::start_on(fault, up.addr, url, None, false, |c| c).await;
    // The schema is on disk before the load (replicas created it): what
    // the crash can lose is the claims and completions.
    pg.psql("CHECKPOINT");
    let traffic = Traffic::new(cluster.addrs(), false, seed);
    let started = Instant::now();
    let load_task = tokio::spawn(traffic.clone().run(WORKERS, CI_LOAD));

    tokio::time::sleep_until((started + INJECT_AT).into()).await;
    let crashed = Instant::now();
    pg.kill();
    pg.restart();
    let events = outage_since(crashed);
    let report = judge(
        fault, name, t0, &up, &cluster, &traffic, load_task, events, CI_LOAD,
    )
    .await;
    assert!(
        report.violations.is_empty(),
        "{} invariant violation(s) under a PostgreSQL crash with synchronous_commit = off; see the report above; {}",
        report.violations.len(),
        replay()
    );
}

// ===== a PostgreSQL failover to a standby =====

/// How the failover runs replicate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Replication {
    /// `synchronous_standby_names = '*'` with a server default of
    /// `synchronous_commit = local` (which alone would not wait for the
    /// standby; idemgate's sessions raise it to `on`).
    SynchronousLocalDefault,
    /// PostgreSQL's default: the standby may lag.
    Asynchronous,
}

/// The primary's WAL sender is stopped (SIGSTOP) this long before the
/// primary crashes: a known lag for the asynchronous run (commits of that
/// window exist on the primary only), and for the synchronous one a
/// standby that acknowledges nothing meanwhile.
const STANDBY_HELD_BACK: Duration = Duration::from_secs(2);

/// The failover runs' lease: longer than their outage (the sender held
/// [`STANDBY_HELD_BACK`], the promotion), as the lazy-commit crash keeps its outage shorter than a
/// lease. They check what a failover does to acknowledged commits; an
/// outage longer than a lease while an answer waits to be recorded lets a
/// retry take the key over once the lease ran out (docs/book/src/deploy.md,
/// Failover), with or without a failover, and is not what they measure.
const FAILOVER_LEASE: &str = "15s";

/// The replicas on a private primary with a streaming standby, both in
/// `store.url`. Under load the primary's WAL sender is held back for
/// [`STANDBY_HELD_BACK`], then the primary is SIGKILLed (the postmaster
/// and every process of it, the held WAL sender included:
/// [`PgCluster::kill`]) and the standby is promoted. Returns the report and the
/// lag (bytes of WAL the standby had not flushed) at the crash, and the
/// answers lost.
async fn failover_run(replication: Replication, name: &'static str) -> FailoverCost {
    let fault = Fault::None;
    let t0 = Instant::now();
    let seed = seed_for(name);
    let up = RecordingUpstream::start(fault.mix(), fault.upstream_timeout(), seed).await;
    let primary_settings = match replication {
        Replication::SynchronousLocalDefault => "synchronous_commit = local\n",
        Replication::Asynchronous => "synchronous_commit = on\n",
    };
    let mut primary = PgCluster::private(primary_settings);
    // Durable WAL on the standby: its files are what survives.
    let standby = primary.standby("synchronous_standby_names = ''\nfsync = on\n");
    if replication == Replication::SynchronousLocalDefault {
        // Set once the standby streams: before, every commit would wait.
        primary.psql("ALTER SYSTEM SET synchronous_standby_names = '*'");
        primary.psql("SELECT pg_reload_conf()");
        primary.wait_for_value(
            "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'",
            "1",
        );
    } else {
        primary.wait_for_value("SELECT count(*) FROM pg_stat_replication", "1");
    }
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?sslmode=disable",
        primary.port, standby.port
    );
    let lease = |c: TestConfig| c.each_route("lease", FAILOVER_LEASE);
    let cluster = Cluster::start_on(fault, up.addr, url, None, false, lease).await;
    let traffic = Traffic::new(cluster.addrs(), false, seed);
    let started = Instant::now();
    let load_task = tokio::spawn(traffic.clone().run(WORKERS, CI_LOAD));

    tokio::time::sleep_until((started + INJECT_AT).into()).await;
    // The primary's WAL sender, not the standby's receiver: what a stopped
    // receiver had not read yet still waits in its socket, and would reach
    // the standby after all.
    primary.signal_wal_sender("-STOP");
    tokio::time::sleep(STANDBY_HELD_BACK).await;
    let lag: i64 = primary
        .query(
            "SELECT coalesce(max(pg_wal_lsn_diff(pg_current_wal_lsn(), flush_lsn)), 0)::bigint \
             FROM pg_stat_replication",
        )
        .parse()
        .expect("a lag in bytes");
    let crashed = Instant::now();
    // The held sender dies with the rest: it never sends another byte.
    primary.kill();
    standby.promote();
    let events = outage_since(crashed);
    let report = judge(
        fault, name, t0, &up, &cluster, &traffic, load_task, events, CI_LOAD,
    )
    .await;
    let lost = lost_answers(&traffic.observations(), crashed);
    println!(
        "standby {lag} bytes of WAL behind at the crash; {} answer(s) lost",
        lost.len()
    );
    for l in lost.iter().take(10) {
        println!("  answer lost: {l}");
    }
    FailoverCost {
        report,
        lag,
        lost: lost.len(),
    }
}

/// What one failover run saw.
struct FailoverCost {
    report: Report,
    /// Bytes of WAL the standby had not flushed at the crash.
    lag: i64,
    /// Keys whose answer had reached its client before the crash and no
    /// longer replays after it ([`lost_answers`]).
    lost: usize,
}

impl FailoverCost {
    /// Keys executed twice without a release (the checker's violations
    /// that say so).
    fn twice(&self) -> usize {
        self.report
            .violations
            .iter()
            .filter(|v| v.contains("executed twice"))
            .count()
    }
}

/// Issue 20 (a) and (c): a failover to a synchronous standby, on a server
/// whose default `synchronous_commit` is `local`, with the standby held
/// back before the crash: every commit idemgate acted on waited for the
/// standby, so no key runs twice and no stored answer is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariants_hold_when_postgres_fails_over_to_a_synchronous_standby() {
    let name = "postgres failover (sync)";
    let run = failover_run(Replication::SynchronousLocalDefault, name).await;
    assert!(
        run.report.violations.is_empty() && run.lost == 0,
        "{} invariant violation(s), {} answer(s) lost, across a failover to a synchronous standby ({} bytes behind); see the report above; {}",
        run.report.violations.len(),
        run.lost,
        run.lag,
        replay()
    );
}

/// Issue 20 (b): the same failover to an asynchronous standby held
/// [`STANDBY_HELD_BACK`] behind. Commits of that window are lost, and
/// with them claims and answers: this measures what that costs (keys run
/// twice, answers lost) and asserts nothing; docs/book/src/deploy.md reports it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_failover_to_an_asynchronous_standby_costs() {
    let name = "postgres failover (async)";
    let run = failover_run(Replication::Asynchronous, name).await;
    println!(
        "asynchronous failover, standby {} bytes ({STANDBY_HELD_BACK:?}) behind: {} violation(s), {} of them a key executed twice; {} answer(s) lost (delivered before the crash, no longer replayed); of {} requests and {} executions",
        run.lag,
        run.report.violations.len(),
        run.twice(),
        run.lost,
        run.report.requests,
        run.report.executions
    );
}

// ===== a Redis failover under Sentinel =====

/// The replicas on the shared PostgreSQL with the fast path through a
/// private Redis Sentinel set (a master, one replica, three sentinels).
/// Under load the master is SIGKILLed; the sentinels promote the replica
/// (about 1.8 s here) and the replicas follow it by themselves, while
/// PostgreSQL answers alone. The outage of the fast path is shorter than
/// the lease (and Redis is never the guard), so nothing may excuse a
/// violation: no key executed twice, every replay identical to what
/// PostgreSQL recorded, no 409 for a completed key. Returns the report
/// and how long the promotion took.
async fn redis_failover_run(name: &'static str) -> (Report, Duration) {
    let fault = Fault::None;
    let t0 = Instant::now();
    let seed = seed_for(name);
    let up = RecordingUpstream::start(fault.mix(), fault.upstream_timeout(), seed).await;
    let db = database_url();
    require_postgres(&db).await;
    let mut set = tokio::task::spawn_blocking(SentinelSet::start)
        .await
        .expect("start the sentinel set");
    let sentinels = set.sentinel_addrs();
    let via_sentinels = |c: TestConfig| {
        c.set("redis.sentinels", sentinels)
            .set("redis.sentinel_master", MASTER_NAME)
            .set("redis.timeout", "250ms")
    };
    let cluster = Cluster::start_on(fault, up.addr, db, None, false, via_sentinels).await;
    let traffic = Traffic::new(cluster.addrs(), false, seed);
    let started = Instant::now();
    let load_task = tokio::spawn(traffic.clone().run(WORKERS, CI_LOAD));

    tokio::time::sleep_until((started + INJECT_AT).into()).await;
    let killed = Instant::now();
    let old = set.kill_master();
    let mut events = vec![Event {
        at: killed,
        kind: EventKind::RedisKilled,
    }];
    let set = tokio::task::spawn_blocking(move || {
        set.wait_promoted(old);
        set
    })
    .await
    .expect("wait for the promotion");
    let promoted = killed.elapsed();
    events.push(Event {
        at: Instant::now(),
        kind: EventKind::RedisRestarted,
    });
    let report = judge(
        fault, name, t0, &up, &cluster, &traffic, load_task, events, CI_LOAD,
    )
    .await;
    println!(
        "redis master SIGKILLed, replica promoted {} ms later",
        promoted.as_millis()
    );
    drop(cluster);
    drop(set);
    (report, promoted)
}

/// Issue 20, Redis: a Sentinel failover under the harness's mixed traffic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariants_hold_when_the_redis_master_fails_over_under_sentinel() {
    let name = "redis sentinel failover";
    let (report, promoted) = redis_failover_run(name).await;
    assert!(
        report.violations.is_empty(),
        "{} invariant violation(s) across a Redis Sentinel failover (promoted after {promoted:?}); see the report above; {}",
        report.violations.len(),
        replay()
    );
}

// ===== h2 upstreams that refuse streams =====

/// Issue 17 defect 7 in the harness: the replicas reach the recording
/// upstream over h2c through a relay that refuses a fifth of the streams
/// (`RST_STREAM` `REFUSED_STREAM`, RFC 9113 §8.7), on an
/// `on_ambiguous = "keep"` route. The invariants hold (no key executed
/// twice without a release), and no client ever gets 424: a refused
/// stream ran nothing, so its key is retried or released, never kept as
/// outcome unknown (nothing else in this mix is ambiguous).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariants_hold_when_an_h2_upstream_refuses_streams() {
    use crate::support::h2_refusing::RefusingH2Relay;
    let t0 = Instant::now();
    let name = "h2 upstream refuses streams";
    let seed = seed_for(name);
    let up = RecordingUpstream::start(Mix::base(), UPSTREAM_TIMEOUT, seed).await;
    let relay = RefusingH2Relay::start(up.addr, 20, seed).await;
    let cluster = Cluster::start_with(Fault::None, relay.addr, |c| {
        c.set("server.upstream_protocol", "h2")
            .each_route("on_ambiguous", "keep")
    })
    .await;
    let traffic = Traffic::new(cluster.addrs(), false, seed);
    tokio::time::timeout(CI_LOAD + DEADLINE, traffic.clone().run(WORKERS, CI_LOAD))
        .await
        .expect("the load ends");
    up.settle(Duration::from_millis(300), DEADLINE).await;
    sweep_every_key(&traffic, &up, LEASE).await;
    let report = check(&Trace {
        fault: name,
        t0,
        executions: up.executions(),
        observations: traffic.observations(),
        events: Vec::new(),
        upstream_timeout: UPSTREAM_TIMEOUT,
        lease: LEASE,
    });
    println!("{report}{}\n{} streams refused", replay(), relay.refused());
    let unknown = traffic
        .observations()
        .into_iter()
        .filter(|o| matches!(&o.seen, Seen::Response(r) if r.status() == 424))
        .count();
    if !report.violations.is_empty() || unknown > 0 {
        println!("replica logs (tails):\n{}", cluster.log_tails());
    }
    assert!(relay.refused() > 0, "the relay refused streams");
    assert!(
        report.violations.is_empty(),
        "{} violation(s); {}",
        report.violations.len(),
        replay()
    );
    assert_eq!(
        unknown,
        0,
        "a refused stream's key was kept as outcome unknown; {}",
        replay()
    );
}

// ===== message consumers (issue 24) =====

/// Messages of a consumer run, each with its own key.
const CONSUMER_MESSAGES: usize = 300;
/// Deliveries one replica holds at once (`prefetch`, `max_ack_pending`):
/// the most keys a SIGKILL can leave in doubt.
const CONSUMER_PREFETCH: usize = 4;
/// Short, so the killed replica's keys are taken over within the run.
const CONSUMER_LEASE: &str = "1s";
/// A consumer run stops by itself within this.
const CONSUMER_BOUND: Duration = Duration::from_secs(85);
/// The consumer's name: the scope of its keys.
const CONSUMER_NAME: &str = "inv";
/// The message header carrying the publish's number, which the recording
/// upstream reads as the execution's request id.
const MESSAGE_ID_HEADER: &str = crate::support::recording_upstream::REQUEST_ID;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BrokerKind {
    Amqp,
    JetStream,
}

/// A private broker a consumer run may stop and start, and the queue (or
/// stream, with its dead-letter stream) on it. The queue is declared
/// first: it is dropped (deleted) while its node still runs.
enum Broker {
    Amqp {
        queue: Option<TestQueue>,
        node: PrivateRabbit,
    },
    JetStream {
        stream: Option<TestStream>,
        server: PrivateNats,
    },
}

impl Broker {
    async fn start(kind: BrokerKind) -> Self {
        match kind {
            BrokerKind::Amqp => {
                let node = PrivateRabbit::start().await;
                let queue = TestQueue::on(&node.url(), "idemgate_inv").await;
                Broker::Amqp {
                    queue: Some(queue),
                    node,
                }
            }
            BrokerKind::JetStream => {
                let server = PrivateNats::start().await;
                let stream = TestStream::new(&server.url(), "idemgate_inv").await;
                Broker::JetStream {
                    stream: Some(stream),
                    server,
                }
            }
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Broker::Amqp { .. } => "consumer, RabbitMQ",
            Broker::JetStream { .. } => "consumer, JetStream",
        }
    }

    /// The `[[consumer]]` table: the message id (RabbitMQ) or the
    /// `x-order-id` header (JetStream drops a repeated `Nats-Msg-Id`
    /// itself) as the key, the short lease, quick retries.
    fn consumer(&self) -> toml::Value {
        let source = match self {
            Broker::Amqp { queue, node } => format!(
                "source = {{ amqp = {{ url = \"{}\", queue = \"{}\", prefetch = {CONSUMER_PREFETCH} }} }}\n",
                node.url(),
                queue.as_ref().expect("the queue").name
            ),
            Broker::JetStream { stream, server } => {
                let stream = stream.as_ref().expect("the stream");
                format!(
                    "source = {{ jetstream = {{ url = \"{}\", stream = \"{}\", durable = \"{CONSUMER_NAME}\", \
                     ack_wait = \"2s\", max_ack_pending = {CONSUMER_PREFETCH}, dead_letter_subject = \"{}\" }} }}\n\
                     key = {{ header = \"x-order-id\" }}\n",
                    server.url(),
                    stream.name,
                    stream.dead_subject
                )
            }
        };
        // max_attempts above the default: JetStream counts a delivery
        // that found its key in flight as an attempt (NOTES L6).
        let text = format!(
            "name = \"{CONSUMER_NAME}\"\n{source}\
             deliver = {{ method = \"POST\", path = \"{ORDERS}\" }}\n\
             lease = \"{CONSUMER_LEASE}\"\nretry_initial = \"100ms\"\nretry_max = \"400ms\"\nmax_attempts = 20\n"
        );
        toml::Value::Table(text.parse().expect("the consumer table parses"))
    }

    async fn publish(&self, p: &Published) {
        let body = std::str::from_utf8(&p.body).expect("a JSON body");
        let request = p.request.to_string();
        let mut headers = vec![(MESSAGE_ID_HEADER, request.as_str())];
        match self {
            Broker::Amqp { queue, .. } => {
                let queue = queue.as_ref().expect("the queue");
                queue.publish_with(p.key.as_deref(), &headers, body).await;
            }
            Broker::JetStream { stream, .. } => {
                if let Some(key) = &p.key {
                    headers.push(("x-order-id", key));
                }
                let stream = stream.as_ref().expect("the stream");
                stream.publish(None, &headers, body).await;
            }
        }
    }

    /// Stops the broker (its messages, durable queues and consumers kept).
    fn stop(&mut self) {
        match self {
            Broker::Amqp { node, .. } => node.down(),
            Broker::JetStream { server, .. } => server.down(),
        }
    }

    /// Starts it again, and the harness's own connection with it.
    async fn start_again(&mut self) {
        match self {
            Broker::Amqp { queue, node } => {
                node.up().await;
                let q = queue.take().expect("the queue");
                *queue = Some(q.reconnected().await);
            }
            Broker::JetStream { stream, server } => {
                server.up().await;
                let s = stream.take().expect("the stream");
                *stream = Some(s.reconnected().await);
            }
        }
    }

    /// The queue's (ready, unacked), or the durable consumer's (pending,
    /// ack pending); `(u64::MAX, u64::MAX)` while it cannot be read.
    async fn left(&self) -> (u64, u64) {
        match self {
            Broker::Amqp { queue, node } => {
                let name = queue.as_ref().expect("the queue").name.clone();
                let node = node.node.clone();
                tokio::task::spawn_blocking(move || rabbitmq_counts_on(&node, &name))
                    .await
                    .unwrap_or((u64::MAX, u64::MAX))
            }
            Broker::JetStream { stream, .. } => {
                let stream = stream.as_ref().expect("the stream");
                match stream.consumer_counts(CONSUMER_NAME).await {
                    Some((pending, unacked)) => (pending, unacked as u64),
                    None => (u64::MAX, u64::MAX),
                }
            }
        }
    }

    /// Every dead letter's message number (its `x-test-request`).
    async fn dead_letters(&self) -> Vec<Option<u64>> {
        let values = match self {
            Broker::Amqp { queue, .. } => {
                let queue = queue.as_ref().expect("the queue");
                queue.drain_dead_letter_header(MESSAGE_ID_HEADER).await
            }
            Broker::JetStream { stream, .. } => {
                let stream = stream.as_ref().expect("the stream");
                stream.dead_letter_header(MESSAGE_ID_HEADER).await
            }
        };
        values
            .into_iter()
            .map(|v| v.and_then(|v| v.parse().ok()))
            .collect()
    }
}

/// What the harness publishes, numbered from 1 (the `x-test-request` of
/// each message).
#[derive(Default)]
struct Outbox {
    published: Vec<Published>,
}

impl Outbox {
    fn message(&mut self, key: Option<String>, body: String) -> Published {
        let p = Published {
            request: self.published.len() as u64 + 1,
            key,
            body: Bytes::from(body),
        };
        self.published.push(p.clone());
        p
    }
}

fn order_key(i: usize) -> String {
    format!("m{i}")
}

fn order_body(i: usize) -> String {
    format!("{{\"order\":{i}}}")
}

/// Polls `f` every 100 ms until it gives a value, at most `bound`.
async fn within<T, F, Fut>(what: &str, bound: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + bound;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {bound:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Keys with an execution whose answer the consumer stores (not one that
/// releases the key).
fn answered_keys(up: &RecordingUpstream) -> std::collections::HashSet<String> {
    up.executions()
        .into_iter()
        .filter(|e| {
            matches!(e.produced, Some(ref p) if !crate::support::checker::releases_key(p.status))
        })
        .filter_map(|e| e.key)
        .collect()
}

/// The store's records by state (the consumer's scope is the only one).
async fn records_by_state(schema: &str) -> BTreeMap<String, i64> {
    let (client, conn) = tokio_postgres::connect(&database_url(), tokio_postgres::NoTls)
        .await
        .expect("connect to PostgreSQL");
    let task = tokio::spawn(conn);
    let rows = client
        .query(
            &format!("SELECT state, count(*) FROM \"{schema}\".idempotency_records GROUP BY state"),
            &[],
        )
        .await
        .expect("read the records");
    drop(client);
    let _ = task.await;
    rows.iter()
        .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
        .collect()
}

/// One consumer run: two replicas on one PostgreSQL schema consume one
/// queue (durable consumer) of a private broker, each reaching the
/// recording upstream through a door of its own. [`CONSUMER_MESSAGES`]
/// messages with a duplicate of every tenth among them; a quarter in,
/// replica 1 is SIGKILLed while the upstream runs one of its deliveries;
/// half-way the broker is stopped and started again, then the killed
/// replica is started again; once every key ran, more duplicates, a
/// different payload under five used keys and three messages without a
/// key. When the broker holds nothing more, [`check_consumer`] judges it.
async fn consumer_run(kind: BrokerKind) -> ConsumerReport {
    let t0 = Instant::now();
    let mut broker = Broker::start(kind).await;
    let name = broker.name();
    let seed = seed_for(name);
    // More slow answers than the HTTP mix: the faults come mid-run.
    let mix = Mix::base().with(Kind::SlowWithinTimeout, 40);
    let up = RecordingUpstream::start_doors(mix, UPSTREAM_TIMEOUT, seed, 2).await;
    require_postgres(&database_url()).await;
    let schema = TestSchema::new();
    let dir = tempfile::TempDir::new().expect("tempdir");
    let configs: Vec<TestConfig> = up
        .doors
        .iter()
        .map(|door| {
            TestConfig::new(*door)
                .set(
                    "server.upstream_timeout",
                    format!("{}ms", UPSTREAM_TIMEOUT.as_millis()),
                )
                .set("server.shutdown_grace", "3s")
                .set("store.backend", "postgres")
                .set("store.url", database_url())
                .set("store.schema", schema.schema.as_str())
                .set("store.pool_size", 4)
                .set("consumer", toml::Value::Array(vec![broker.consumer()]))
        })
        .collect();

    let mut outbox = Outbox::default();
    for i in 0..CONSUMER_MESSAGES {
        let p = outbox.message(Some(order_key(i)), order_body(i));
        broker.publish(&p).await;
        if i % 10 == 9 {
            let p = outbox.message(Some(order_key(i - 4)), order_body(i - 4));
            broker.publish(&p).await;
        }
    }
    let mut replicas: Vec<Replica> = (0..2)
        .map(|index| Replica {
            index,
            listen: crate::support::free_port(),
            admin: crate::support::free_port(),
            env: Vec::new(),
            process: None,
            starts: 0,
        })
        .collect();
    for r in &mut replicas {
        r.start(&configs[r.index], dir.path()).await;
    }

    let mut events = Vec::new();
    let step = Duration::from_secs(30);
    within("a quarter of the keys to run", step, || async {
        (answered_keys(&up).len() >= CONSUMER_MESSAGES / 4).then_some(())
    })
    .await;
    within("replica 1 to hold a delivery upstream", step, || async {
        let holds = up
            .executions()
            .iter()
            .any(|e| e.door == 1 && e.answered.is_none());
        holds.then_some(())
    })
    .await;
    events.push(Event {
        at: Instant::now(),
        kind: EventKind::Killed(1),
    });
    replicas[1].running().kill();
    replicas[1].process = None;

    within("half of the keys to run", step, || async {
        (answered_keys(&up).len() >= CONSUMER_MESSAGES / 2).then_some(())
    })
    .await;
    events.push(Event {
        at: Instant::now(),
        kind: EventKind::BrokerStopped,
    });
    broker.stop();
    let done = answered_keys(&up).len();
    assert!(
        done < CONSUMER_MESSAGES,
        "the broker stopped after every key ran ({done}): not mid-run"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    broker.start_again().await;
    events.push(Event {
        at: Instant::now(),
        kind: EventKind::BrokerStarted,
    });
    replicas[1].start(&configs[1], dir.path()).await;
    events.push(Event {
        at: Instant::now(),
        kind: EventKind::Restarted(1),
    });
    let keys: Vec<String> = (0..CONSUMER_MESSAGES).map(order_key).collect();
    within("every key to run", Duration::from_secs(40), || async {
        let done = answered_keys(&up);
        keys.iter().all(|k| done.contains(k)).then_some(())
    })
    .await;

    // Late: duplicates of settled messages, a different payload under used
    // keys (dead-lettered as `mismatch`), messages without a key.
    for i in (0..CONSUMER_MESSAGES).step_by(10) {
        let p = outbox.message(Some(order_key(i)), order_body(i));
        broker.publish(&p).await;
    }
    for i in (3..CONSUMER_MESSAGES).step_by(CONSUMER_MESSAGES / 5) {
        let body = format!("{{\"order\":{i},\"changed\":true}}");
        let p = outbox.message(Some(order_key(i)), body);
        broker.publish(&p).await;
    }
    for i in 0..3 {
        let p = outbox.message(None, format!("{{\"no_key\":{i}}}"));
        broker.publish(&p).await;
    }
    // Settled: nothing left twice in a row, the upstream quiet.
    let mut last = (u64::MAX, u64::MAX);
    let left = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            up.settle(Duration::from_millis(300), DEADLINE).await;
            let now = broker.left().await;
            if now == (0, 0) && last == (0, 0) {
                return now;
            }
            last = now;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
    .await
    .unwrap_or(last);
    let dead_letters = broker.dead_letters().await;
    let records = records_by_state(&schema.schema).await;
    for r in &mut replicas {
        r.process = None;
    }
    let report = check_consumer(&ConsumerTrace {
        fault: name,
        t0,
        published: outbox.published,
        executions: up.executions(),
        events,
        upstream_timeout: UPSTREAM_TIMEOUT,
        prefetch: CONSUMER_PREFETCH,
        dead_letters,
        left,
        records,
    });
    println!("{report}{}", replay());
    if !report.report.violations.is_empty() {
        println!("replica logs (tails):\n{}", log_tails(dir.path()));
    }
    report
}

/// Runs [`consumer_run`] within [`CONSUMER_BOUND`] and fails naming each
/// violated invariant and its messages.
async fn consumer_holds(kind: BrokerKind) {
    let started = Instant::now();
    let report = tokio::time::timeout(CONSUMER_BOUND, consumer_run(kind))
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the {kind:?} consumer run did not end within {CONSUMER_BOUND:?}; {}",
                replay()
            )
        });
    let v = &report.report.violations;
    assert!(
        v.is_empty(),
        "{} consumer invariant violation(s) in {:.1} s:\n  {}\n{}",
        v.len(),
        started.elapsed().as_secs_f64(),
        v.iter().take(20).cloned().collect::<Vec<_>>().join("\n  "),
        replay()
    );
}

/// Issue 24 on RabbitMQ: a replica SIGKILLed mid-delivery and the broker
/// restarted mid-run; nothing lost, nothing run twice but the killed
/// replica's keys in doubt, every duplicate suppressed, dead letters only
/// where the fate table puts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariants_hold_for_an_amqp_consumer_across_a_replica_kill_and_a_broker_restart() {
    consumer_holds(BrokerKind::Amqp).await;
}

/// The same on NATS JetStream (a durable pull consumer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariants_hold_for_a_jetstream_consumer_across_a_replica_kill_and_a_broker_restart() {
    consumer_holds(BrokerKind::JetStream).await;
}

// ===== the soak =====

/// Every fault for `IDEMGATE_SOAK_SECS` (default 300) in all, injected
/// again and again; prints one report for all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: run it with scripts/soak.sh [SECONDS]"]
async fn soak() {
    let total = std::env::var("IDEMGATE_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(DEFAULT_SOAK_SECS);
    let per_fault = Duration::from_secs(total / ALL_FAULTS.len() as u64).max(CI_LOAD);
    let mut reports = Vec::new();
    for fault in ALL_FAULTS {
        reports.push(run(fault, per_fault, Schedule::Repeated).await);
    }
    // The failovers need a private primary and standby (or Redis master,
    // replica and sentinels) of their own, so they run once each; the
    // asynchronous PostgreSQL one is a measurement.
    let sync = Replication::SynchronousLocalDefault;
    let sync_failover = failover_run(sync, "postgres failover (sync)").await;
    let sync_lost = sync_failover.lost;
    reports.push(sync_failover.report);
    reports.push(redis_failover_run("redis sentinel failover").await.0);
    let unsafe_failover =
        failover_run(Replication::Asynchronous, "postgres failover (async)").await;
    println!(
        "\nsoak invariant report ({} s of load per fault)\n{}",
        per_fault.as_secs(),
        Report::header()
    );
    for r in &reports {
        println!("{}", r.line());
    }
    println!(
        "{}   (measured, not asserted: standby {} bytes behind, {} key(s) executed twice, {} answer(s) lost)",
        unsafe_failover.report.line(),
        unsafe_failover.lag,
        unsafe_failover.twice(),
        unsafe_failover.lost
    );
    println!("postgres failover (sync): {sync_lost} answer(s) lost");
    for r in reports.iter().filter(|r| !r.violations.is_empty()) {
        println!("\n{}: {} violation(s)", r.fault, r.violations.len());
        for v in r.violations.iter().take(10) {
            println!("  {v}");
        }
    }
    let failed: Vec<&str> = reports
        .iter()
        .filter(|r| !r.violations.is_empty())
        .map(|r| r.fault)
        .collect();
    assert!(
        failed.is_empty() && sync_lost == 0,
        "invariants violated under: {failed:?}; {sync_lost} answer(s) lost across the synchronous failover; {}",
        replay()
    );
}

// ===== the checker itself =====

/// The checker is not vacuous: each invariant, broken on purpose in a
/// hand-made trace, is reported, and its lawful twin is not.
#[test]
fn the_checker_reports_each_broken_invariant_and_nothing_else() {
    use crate::support::recording_upstream::{Behaviour, Execution, Produced};
    use crate::support::traffic::Observation;
    use crate::support::Resp;
    use bytes::Bytes;
    use http::{HeaderMap, HeaderValue, StatusCode, Version};

    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let alice = Some("Bearer alice");
    let bob = Some("Bearer bob");
    let body_a = Bytes::from_static(b"{\"v\":\"a\"}");
    let body_b = Bytes::from_static(b"{\"v\":\"b\"}");
    let answer = |status: u16| Behaviour::Answer {
        status,
        delay: Duration::from_millis(10),
    };
    let exec = |seq: u64, request: u64, scope: Option<&str>, body: &Bytes, behaviour, ms: u64| {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.insert("x-exec", HeaderValue::from(seq));
        let status = match behaviour {
            Behaviour::Answer { status, .. } => status,
            _ => 201,
        };
        Execution {
            seq,
            door: 0,
            arrived: at(ms),
            scope: scope.map(str::to_string),
            key: Some("k1".into()),
            request_id: Some(request),
            body: body.clone(),
            behaviour,
            answered: Some(at(ms + 10)),
            produced: Some(Produced {
                status,
                headers,
                body: Bytes::from(format!("{{\"exec\":{seq}}}")),
            }),
        }
    };
    let resp = |e: &Execution, replayed: bool| {
        let p = e.produced.clone().expect("produced");
        let mut headers = p.headers;
        // What idemgate says it did, as the proxy sets it.
        let said = match (replayed, p.status) {
            (true, _) => "replayed",
            (false, 408 | 425 | 429 | 500..) => "released",
            (false, _) => "created",
        };
        headers.insert("idempotency-status", HeaderValue::from_static(said));
        if replayed {
            headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
        }
        Seen::Response(Resp {
            status: StatusCode::from_u16(p.status).expect("status"),
            version: Version::HTTP_11,
            headers,
            body: p.body,
        })
    };
    let obs =
        |id: u64, scope: Option<&'static str>, body: &Bytes, ms: u64, seen: Seen| Observation {
            id,
            phase: Phase::Load,
            scope,
            key: "k1".into(),
            body: body.clone(),
            replica: 0,
            started: at(ms),
            ended: at(ms + 30),
            seen,
        };
    let verdict =
        |executions: Vec<Execution>, observations: Vec<Observation>, events: Vec<Event>| {
            check(&Trace {
                fault: "synthetic",
                t0,
                executions,
                observations,
                events,
                upstream_timeout: UPSTREAM_TIMEOUT,
                lease: LEASE,
            })
            .violations
        };
    let killed = |ms| Event {
        at: at(ms),
        kind: EventKind::Killed(0),
    };

    // An execution's answer must say what idemgate did with it.
    let e1 = exec(1, 1, alice, &body_a, answer(201), 0);
    let mut wrong = resp(&e1, false);
    if let Seen::Response(r) = &mut wrong {
        r.headers
            .insert("idempotency-status", HeaderValue::from_static("released"));
    }
    let v = verdict(vec![e1], vec![obs(1, alice, &body_a, 0, wrong)], vec![]);
    assert_eq!(v.len(), 1, "{v:?}");
    assert!(
        v[0].contains("with Idempotency-Status Some(\"released\")"),
        "{v:?}"
    );

    // Two executions: lawful after a 503, a violation after a 201.
    for (first, expected) in [(503, None), (201, Some("executed twice without a release"))] {
        let (e1, e2) = (
            exec(1, 1, alice, &body_a, answer(first), 0),
            exec(2, 2, alice, &body_a, answer(201), 100),
        );
        let v = verdict(
            vec![e1.clone(), e2.clone()],
            vec![
                obs(1, alice, &body_a, 0, resp(&e1, false)),
                obs(2, alice, &body_a, 100, resp(&e2, false)),
            ],
            vec![],
        );
        assert_eq!(v.len(), usize::from(expected.is_some()), "{v:?}");
        assert!(expected.is_none_or(|x| v[0].contains(x)), "{v:?}");
    }

    // A store cut longer than the lease while the first answer waited to be
    // recorded: the same request may run again after it (documented), not
    // after a cut shorter than the lease, and never another request.
    let cut = |from: u64, to: u64| {
        vec![
            Event {
                at: at(from),
                kind: EventKind::PostgresCut,
            },
            Event {
                at: at(to),
                kind: EventKind::PostgresRestored,
            },
        ]
    };
    for (events, body2, expected) in [
        (cut(50, 50 + 2500), &body_a, None),
        (
            cut(50, 50 + 1000),
            &body_a,
            Some("executed twice without a release"),
        ),
        (
            cut(50, 50 + 2500),
            &body_b,
            Some("taken over by a different request"),
        ),
    ] {
        let (e1, e2) = (
            exec(1, 1, alice, &body_a, answer(201), 0),
            exec(2, 2, alice, body2, answer(201), 2600),
        );
        let v = verdict(
            vec![e1.clone(), e2.clone()],
            vec![
                obs(1, alice, &body_a, 0, resp(&e1, false)),
                obs(2, alice, body2, 2600, resp(&e2, false)),
            ],
            events,
        );
        assert_eq!(v.len(), usize::from(expected.is_some()), "{v:?}");
        assert!(expected.is_none_or(|x| v[0].contains(x)), "{v:?}");
    }

    // Replays: of its own scope and request (lawful); across scopes, of a
    // different body, altered, or of an answer that releases the key.
    let e1 = exec(1, 1, alice, &body_a, answer(201), 0);
    let mut altered = resp(&e1, true);
    if let Seen::Response(r) = &mut altered {
        r.status = StatusCode::ACCEPTED;
    }
    let e429 = exec(1, 1, alice, &body_a, answer(429), 0);
    for (e, replay, expected) in [
        (&e1, obs(2, alice, &body_a, 100, resp(&e1, true)), None),
        (
            &e1,
            obs(2, bob, &body_a, 100, resp(&e1, true)),
            Some("another scope"),
        ),
        (
            &e1,
            obs(2, alice, &body_b, 100, resp(&e1, true)),
            Some("different request"),
        ),
        (
            &e1,
            obs(2, alice, &body_a, 100, altered),
            Some("differs from the original"),
        ),
        (
            &e429,
            obs(2, alice, &body_a, 100, resp(&e429, true)),
            Some("releases the key"),
        ),
    ] {
        let v = verdict(
            vec![e.clone()],
            vec![obs(1, alice, &body_a, 0, resp(e, false)), replay],
            vec![],
        );
        assert_eq!(v.len(), usize::from(expected.is_some()), "{v:?}");
        assert!(expected.is_none_or(|x| v[0].contains(x)), "{v:?}");
    }

    // A 409: lawful while the key may be in flight, a violation once a
    // replay showed it completed, unless the key ran anew in between.
    let conflict = || {
        let mut headers = HeaderMap::new();
        headers.insert(
            "content-type",
            HeaderValue::from_static("application/problem+json"),
        );
        headers.insert("retry-after", HeaderValue::from_static("1"));
        Seen::Response(Resp {
            status: StatusCode::CONFLICT,
            version: Version::HTTP_11,
            headers,
            body: Bytes::from_static(
                b"{\"type\":\"https://github.com/idemgate/idemgate#problem-in-flight\",\"detail\":\"in flight\"}",
            ),
        })
    };
    let e1 = exec(1, 1, alice, &body_a, answer(201), 0);
    let e2 = exec(2, 4, alice, &body_a, answer(201), 150);
    for (executions, at_ms, expected) in [
        (vec![e1.clone()], 5, None),
        (vec![e1.clone()], 200, Some("409 although request 2")),
        (vec![e1.clone(), e2.clone()], 200, None),
    ] {
        let v = verdict(
            executions,
            vec![
                obs(1, alice, &body_a, 0, resp(&e1, false)),
                obs(2, alice, &body_a, 100, resp(&e1, true)),
                obs(3, alice, &body_b, at_ms, conflict()),
            ],
            vec![],
        );
        let v: Vec<_> = v.into_iter().filter(|v| v.contains("409")).collect();
        assert_eq!(v.len(), usize::from(expected.is_some()), "{v:?}");
        assert!(expected.is_none_or(|x| v[0].contains(x)), "{v:?}");
    }

    // A request without an answer: lawful only when its replica was down.
    let refused = || obs(1, alice, &body_a, 0, Seen::Transport("refused".into()));
    assert!(verdict(vec![], vec![refused()], vec![killed(10)]).is_empty());
    let v = verdict(vec![], vec![refused()], vec![]);
    assert!(
        v.len() == 1 && v[0].contains("no fault to explain it"),
        "{v:?}"
    );
    let v = verdict(vec![], vec![obs(1, alice, &body_a, 0, Seen::Hung)], vec![]);
    assert!(v.len() == 1 && v[0].contains("no answer"), "{v:?}");

    // A killed holder's key: taken over by the same request (lawful), by
    // a different one (a violation).
    for (body, expected) in [(&body_a, None), (&body_b, Some("by a different request"))] {
        let e1 = exec(1, 1, alice, &body_a, answer(201), 0);
        let e2 = exec(2, 2, alice, body, answer(201), 3000);
        let lost = obs(1, alice, &body_a, 0, Seen::Transport("reset".into()));
        let v = verdict(
            vec![e1, e2.clone()],
            vec![lost, obs(2, alice, body, 3000, resp(&e2, false))],
            vec![killed(20)],
        );
        assert_eq!(v.len(), usize::from(expected.is_some()), "{v:?}");
        assert!(expected.is_none_or(|x| v[0].contains(x)), "{v:?}");
    }

    // Regression: a request the victim sent just before its SIGKILL can be
    // read by the upstream just after the kill's stamp; its key is still
    // abandoned ("executed twice without a release" was reported once in
    // a loaded full-suite run).
    let e1 = exec(1, 1, alice, &body_a, answer(201), 25);
    let e2 = exec(2, 2, alice, &body_a, answer(201), 3000);
    let lost = obs(1, alice, &body_a, 0, Seen::Transport("reset".into()));
    let v = verdict(
        vec![e1, e2.clone()],
        vec![lost, obs(2, alice, &body_a, 3000, resp(&e2, false))],
        vec![killed(20)],
    );
    assert!(v.is_empty(), "{v:?}");

    // Answers lost to a crash at 1000 ms: an answer its client had before
    // the crash is lost when the key's last answer is another execution,
    // not when it still replays; an answer delivered after the crash, or
    // one that releases the key, is not counted.
    let e1 = exec(1, 1, alice, &body_a, answer(201), 0);
    let e2 = exec(2, 3, alice, &body_a, answer(201), 3000);
    let crash = at(1000);
    let first = || obs(1, alice, &body_a, 0, resp(&e1, false));
    let lost = lost_answers(
        &[first(), obs(3, alice, &body_a, 3000, resp(&e2, false))],
        crash,
    );
    assert!(
        lost.len() == 1 && lost[0].contains("execution 1 before the crash"),
        "{lost:?}"
    );
    let kept = [first(), obs(2, alice, &body_a, 3000, resp(&e1, true))];
    assert!(lost_answers(&kept, crash).is_empty());
    let busy = [
        first(),
        obs(2, alice, &body_a, 2000, resp(&e1, true)),
        obs(4, alice, &body_a, 3000, conflict()),
    ];
    let lost = lost_answers(&busy, crash);
    assert!(
        lost.len() == 1 && lost[0].ends_with("the key's last answer is a 409"),
        "{lost:?}"
    );
    assert!(
        lost_answers(&[first()], at(10)).is_empty(),
        "delivered after"
    );
    let e503 = exec(1, 1, alice, &body_a, answer(503), 0);
    let released = [
        obs(1, alice, &body_a, 0, resp(&e503, false)),
        obs(3, alice, &body_a, 3000, resp(&e2, false)),
    ];
    assert!(lost_answers(&released, crash).is_empty());
}

/// The consumer checker is not vacuous either: each consumer invariant,
/// broken on purpose in a hand-made trace, is reported, and its lawful
/// twin is not.
#[test]
fn the_consumer_checker_reports_each_broken_invariant_and_nothing_else() {
    use crate::support::recording_upstream::{Behaviour, Execution, Produced};
    use http::HeaderMap;

    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let body = |i: u64| Bytes::from(format!("{{\"order\":{i}}}"));
    let message = |request: u64, key: Option<&str>, b: Bytes| Published {
        request,
        key: key.map(str::to_string),
        body: b,
    };
    // Execution `seq` of message `request` by replica `door`.
    let exec = |seq: u64, door: usize, request: u64, key: &str, status: u16, ms: u64| Execution {
        seq,
        door,
        arrived: at(ms),
        scope: None,
        key: Some(key.to_string()),
        request_id: Some(request),
        body: body(1),
        behaviour: Behaviour::Answer {
            status,
            delay: Duration::from_millis(10),
        },
        answered: Some(at(ms + 10)),
        produced: Some(Produced {
            status,
            headers: HeaderMap::new(),
            body: Bytes::new(),
        }),
    };
    let completed = |n: i64| BTreeMap::from([("completed".to_string(), n)]);
    let trace = |published: Vec<Published>, executions: Vec<Execution>| ConsumerTrace {
        fault: "synthetic",
        t0,
        published,
        executions,
        events: Vec::new(),
        upstream_timeout: UPSTREAM_TIMEOUT,
        prefetch: 4,
        dead_letters: Vec::new(),
        left: (0, 0),
        records: completed(1),
    };
    let verdict = |t: &ConsumerTrace| check_consumer(t);
    let one = |v: &[String], what: &str| {
        assert!(v.len() == 1 && v[0].contains(what), "{what}: {v:?}");
    };
    let pair = || {
        vec![
            message(1, Some("m1"), body(1)),
            message(2, Some("m1"), body(1)),
        ]
    };

    // A duplicate answered from the record: lawful, counted as suppressed.
    let r = verdict(&trace(pair(), vec![exec(1, 0, 1, "m1", 201, 0)]));
    assert!(r.report.violations.is_empty(), "{r}");
    assert_eq!((r.duplicates, r.suppressed), (1, 1));

    // The duplicate ran too: lawful after a 503, not after a 201.
    let after = |first| vec![exec(1, 0, 1, "m1", first, 0), exec(2, 0, 2, "m1", 201, 200)];
    let r = verdict(&trace(pair(), after(503)));
    assert!(r.report.violations.is_empty(), "{r}");
    assert_eq!(r.report.releases, 1);
    one(
        &verdict(&trace(pair(), after(201))).report.violations,
        "executed twice without a release",
    );

    // The killed replica's key in doubt, taken over by its redelivery:
    // lawful and counted; not when its answer was long recorded, nor
    // beyond what the replica could hold.
    let killed = |kill_ms: u64, prefetch: usize| {
        let mut first = exec(1, 1, 1, "m1", 201, 0);
        first.answered = None;
        first.produced = None;
        let mut t = trace(
            vec![message(1, Some("m1"), body(1))],
            vec![first, exec(2, 0, 1, "m1", 201, 3000)],
        );
        t.events.push(Event {
            at: at(kill_ms),
            kind: EventKind::Killed(1),
        });
        t.prefetch = prefetch;
        t
    };
    let r = verdict(&killed(20, 4));
    assert!(r.report.violations.is_empty(), "{r}");
    assert_eq!(r.taken_over, [("m1".to_string(), 1, 2)]);
    assert_eq!((r.in_flight_at_kill, r.answered_before_kill), (1, 0));
    one(
        &verdict(&killed(20, 0)).report.violations,
        "more than the killed replica could hold",
    );
    let mut recorded = killed(2500, 4);
    recorded.executions[0].answered = Some(at(10));
    recorded.executions[0].produced = recorded.executions[1].produced.clone();
    one(
        &verdict(&recorded).report.violations,
        "executed twice without a release",
    );
    one(
        &verdict(&killed(4000, 4)).report.violations,
        "before the kill",
    );

    // Lost: a message that never ran; a broker that still holds messages;
    // a store with a record left in flight.
    let mut never = trace(vec![message(1, Some("m1"), body(1))], vec![]);
    never.records = completed(0);
    one(
        &verdict(&never).report.violations,
        "lost: message 1 (key m1) never executed",
    );
    let mut held = trace(pair(), vec![exec(1, 0, 1, "m1", 201, 0)]);
    held.left = (1, 0);
    one(&verdict(&held).report.violations, "the broker ends with 1");
    held.left = (0, 0);
    held.records.insert("in_flight".into(), 1);
    one(&verdict(&held).report.violations, "1 record(s) in_flight");

    // Dead letters: a stored 404 and its duplicate are dead-lettered, a
    // 201 is not, a message without a key and a different payload are.
    let mut dead = trace(pair(), vec![exec(1, 0, 1, "m1", 404, 0)]);
    dead.dead_letters = vec![Some(1), Some(2)];
    assert!(verdict(&dead).report.violations.is_empty());
    dead.dead_letters = vec![Some(1)];
    one(
        &verdict(&dead).report.violations,
        "message 2 (key m1) was not dead-lettered although its key's recorded answer is 404",
    );
    let mut acked = trace(pair(), vec![exec(1, 0, 1, "m1", 201, 0)]);
    acked.dead_letters = vec![Some(2)];
    one(
        &verdict(&acked).report.violations,
        "was dead-lettered 1 time(s)",
    );
    let mut odd = trace(
        vec![
            message(1, Some("m1"), body(1)),
            message(2, Some("m1"), body(2)),
            message(3, None, body(3)),
        ],
        vec![exec(1, 0, 1, "m1", 201, 0)],
    );
    odd.dead_letters = vec![Some(2), Some(3)];
    let r = verdict(&odd);
    assert!(r.report.violations.is_empty(), "{r}");
    assert_eq!(r.report.mismatches, 1);
    odd.dead_letters = vec![Some(2)];
    one(
        &verdict(&odd).report.violations,
        "message 3 (key -) was not dead-lettered although no key",
    );
}

/// A replay draws what the failed run drew: a derived generator depends on
/// the seed and its label only, and different labels draw apart.
#[test]
fn the_harness_seed_derives_the_same_generators_for_the_same_labels() {
    use rand::Rng;
    let draws = |seed: u64, label: &str| -> Vec<u32> {
        let mut rng = Seed(seed).rng(label);
        (0..8).map(|_| rng.random()).collect()
    };
    assert_eq!(draws(42, "worker 0"), draws(42, "worker 0"));
    assert_ne!(draws(42, "worker 0"), draws(42, "worker 1"));
    assert_ne!(draws(42, "worker 0"), draws(43, "worker 0"));
    // Pinned, so a change of the derivation (which would break replaying
    // a seed from an older report) is noticed.
    assert_eq!(Seed(42).derive("worker 0"), Seed(7_808_677_657_598_959_783));
}
