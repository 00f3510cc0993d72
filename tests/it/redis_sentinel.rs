//! The Redis fast path through Redis Sentinel (`redis.sentinels`), against
//! a private master, replica and three sentinels the test starts, with the
//! real binary on PostgreSQL:
//! - a stale lock copy of a key PostgreSQL has completed replays, never 409;
//! - the master SIGKILLed under traffic: Sentinel promotes the replica, the
//!   fast path follows it by itself, and every key ran exactly once;
//! - a copy the promoted replica still holds of a record PostgreSQL has
//!   deleted (the `DEL` never reached it) is never replayed: key names
//!   carry the master's epoch;
//! - the same over TLS (`redis.tls`), through a failover.
//!
//! The promotion and fast-path-back times it prints are the figures in
//! docs/book/src/deploy.md ("Failover").

use crate::support::fast_path::{
    config_on_postgres, delete_key, epoch_of, executions, fast_path_hits,
};
use crate::support::process::run_to_completion;
use crate::support::redis_sentinel::{Auth, SentinelSet, MASTER_NAME};
use crate::support::services::{database_url, require_postgres, TestSchema};
use crate::support::{ServeProcess, Upstream, ORDERS};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BODY: &str = r#"{"item":"book"}"#;

/// Bounds the whole failover test: setup, traffic, failover, checks.
const WHOLE: Duration = Duration::from_secs(90);

/// Writes the config and starts `idemgate serve` on PostgreSQL with the
/// fast path through `set`'s sentinels.
async fn serve(
    up: &Upstream,
    schema: &TestSchema,
    set: &SentinelSet,
    config: &std::path::Path,
    env: &[(&str, &str)],
) -> ServeProcess {
    let (listen, admin) = (crate::support::free_port(), crate::support::free_port());
    let mut file = config_on_postgres(up.addr, listen, admin, schema)
        .set("redis.sentinels", set.sentinel_addrs())
        .set("redis.sentinel_master", MASTER_NAME)
        .set("redis.timeout", "1s");
    if let Some(ca) = set.ca_file() {
        file = file.set("redis.tls", true).set("redis.ca_file", ca);
    }
    file.write(config);
    let env: Vec<(&str, &str)> = [("RUST_LOG", "info")]
        .into_iter()
        .chain(env.iter().copied())
        .collect();
    ServeProcess::start(config, listen, admin, &env).await
}

/// The one name under `prefix` on `port` that is not in `known`.
fn new_name(set: &SentinelSet, port: u16, prefix: &str, known: &[String]) -> Option<String> {
    let names: Vec<String> = set
        .keys(port, &format!("{prefix}:*"))
        .into_iter()
        .filter(|n| !known.contains(n))
        .collect();
    (names.len() == 1).then(|| names[0].clone())
}

/// Sends `key` twice at once, then retries whatever was not a replay or the
/// execution (a 409 from the twin in flight, a 5xx) until it replays;
/// returns every answer's status and the executed body.
async fn store_with_retries(serve: &ServeProcess, key: &str) -> (Vec<u16>, Vec<u8>) {
    let twins = [
        serve.post(ORDERS).key(key).body(BODY).send(),
        serve.post(ORDERS).key(key).body(BODY).send(),
    ];
    let answers = futures_util::future::join_all(twins).await;
    let mut statuses: Vec<u16> = answers.iter().map(|r| r.status()).collect();
    let mut body = answers
        .iter()
        .find(|r| r.status() == 201)
        .map(|r| r.body.to_vec());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = serve.post(ORDERS).key(key).body(BODY).send().await;
        statuses.push(r.status());
        if r.status() == 201 {
            match &body {
                Some(b) => assert_eq!(&r.body[..], &b[..], "{key}: another body"),
                None => body = Some(r.body.to_vec()),
            }
            if r.replayed() {
                break;
            }
        }
        assert!(Instant::now() < deadline, "{key}: no replay: {statuses:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (statuses, body.expect("an execution"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_under_traffic_keeps_every_key_exactly_once() {
    tokio::time::timeout(WHOLE, failover_under_traffic())
        .await
        .expect("the sentinel failover test finished in time");
}

async fn failover_under_traffic() {
    require_postgres(&database_url()).await;
    let mut set = SentinelSet::start();
    let up = Upstream::start().await;
    let schema = TestSchema::new();
    let dir = tempfile::TempDir::new().expect("tempdir");
    let config = dir.path().join("idemgate.toml");
    let serve = Arc::new(serve(&up, &schema, &set, &config, &[]).await);
    let prefix = schema.prefix.as_str();
    let first_master = set.master_port();
    crate::support::wait_for("the fast path on the sentinels' master", || async {
        let r = serve.post(ORDERS).key("warm-up").body(BODY).send().await;
        assert_eq!(r.status(), 201, "{}", r.text());
        (fast_path_hits(&serve).await > 0).then_some(())
    })
    .await;
    let check = run_to_completion(
        &["check-config", "--connect", "-c", config.to_str().unwrap()],
        &[],
    )
    .await;
    let said = format!("{}{}", check.stdout, check.stderr);
    assert_eq!(check.code, 0, "{said}");
    assert!(
        said.contains(&format!(
            "redis sentinel at sentinel master \"{MASTER_NAME}\" via 127.0.0.1:"
        )),
        "{said}"
    );
    let mut known = set.keys(first_master, &format!("{prefix}:*"));
    assert_eq!(known.len(), 1, "{known:?}");

    // 1. A stale lock copy: the lock a request held while in flight, put
    // back after PostgreSQL completed the key (what a lagging replica, or
    // a completion whose Redis write was lost, leaves). It replays.
    let slow = serve
        .post(&format!("{ORDERS}?delay_ms=1500"))
        .key("stale-lock")
        .body(BODY);
    let slow = tokio::spawn(slow.send());
    let name = crate::support::wait_for("the in-flight lock in redis", || async {
        new_name(&set, first_master, prefix, &known)
    })
    .await;
    let lock = set.get(first_master, &name).expect("the lock");
    let done = slow.await.expect("request task");
    assert_eq!(done.status(), 201, "{}", done.text());
    assert_ne!(set.get(first_master, &name), Some(lock.clone()));
    set.set_px(first_master, &name, &lock, 60_000);
    let again = serve
        .post(&format!("{ORDERS}?delay_ms=1500"))
        .key("stale-lock")
        .body(BODY)
        .send()
        .await;
    assert!(again.replayed(), "a stale lock answered: {again:?}");
    assert_eq!(again.body, done.body);
    assert_eq!(executions(&up, "stale-lock"), 1);
    known.push(name);

    // 2. A record an operator deletes before the failover; its copy as the
    // replica had it before the delete's `DEL` reached it (kept here, and
    // put on the promoted replica after the failover: a replica that
    // lagged holds exactly that).
    let deleted = serve.post(ORDERS).key("deleted").body(BODY).send().await;
    assert_eq!(deleted.status(), 201, "{}", deleted.text());
    let deleted_name = crate::support::wait_for("the completed copy in redis", || async {
        new_name(&set, first_master, prefix, &known)
    })
    .await;
    let deleted_copy = set.get(first_master, &deleted_name).expect("the copy");
    delete_key(&config, "deleted").await;
    assert_eq!(set.get(first_master, &deleted_name), None);

    // 3. Traffic, two workers of new keys; the master dies under it.
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..2)
        .map(|w| {
            let (serve, stop) = (serve.clone(), stop.clone());
            tokio::spawn(async move {
                let mut done = HashMap::new();
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let key = format!("t{w}-{i}");
                    done.insert(key.clone(), store_with_retries(&serve, &key).await);
                    i += 1;
                }
                done
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before_kill = fast_path_hits(&serve).await;
    assert!(before_kill > 2, "no fast path before the kill");
    let replica = set.replica_port();
    let killed_at = Instant::now();
    let old = set.kill_master();
    let promoted = tokio::task::block_in_place(|| set.wait_promoted(old));
    assert_eq!(promoted, replica, "the one replica is promoted");
    let promotion = killed_at.elapsed();
    let at_promotion = fast_path_hits(&serve).await;
    let back = crate::support::wait_for("the fast path on the promoted master", || async {
        (fast_path_hits(&serve).await > at_promotion).then(|| killed_at.elapsed())
    })
    .await;
    // More traffic on the new master, then stop.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.store(true, Ordering::Relaxed);
    let mut traffic = HashMap::new();
    for w in workers {
        traffic.extend(w.await.expect("worker"));
    }
    eprintln!(
        "sentinel failover: promotion {} ms after the kill, fast path back {} ms after the kill; {} keys",
        promotion.as_millis(),
        back.as_millis(),
        traffic.len()
    );

    // Every key ran exactly once, whatever the failover did.
    for (key, (statuses, _)) in &traffic {
        assert_eq!(executions(&up, key), 1, "{key} ran twice: {statuses:?}");
        for s in statuses {
            assert!(matches!(s, 201 | 409), "{key}: {statuses:?}");
        }
    }

    // The fast path writes the new master's copies under its own epoch;
    // the old master's (replicated) ones are still there, unread.
    let names = set.keys(promoted, &format!("{prefix}:*"));
    let old_epoch = epoch_of(&deleted_name, prefix);
    let new_names: Vec<&String> = names
        .iter()
        .filter(|n| epoch_of(n, prefix) != old_epoch)
        .collect();
    assert!(
        !new_names.is_empty(),
        "no copy on the new master: {names:?}"
    );
    assert!(names.len() > new_names.len(), "{names:?}");

    // 4. The promoted replica holds the deleted record's copy (step 2):
    // it must not replay, the key runs again.
    set.set_px(promoted, &deleted_name, &deleted_copy, 60_000);
    let rerun = serve.post(ORDERS).key("deleted").body(BODY).send().await;
    assert_eq!(rerun.status(), 201, "{}", rerun.text());
    assert!(
        !rerun.replayed(),
        "a deleted record replayed from a stale copy"
    );
    assert_eq!(executions(&up, "deleted"), 2);
    let log = serve.log();
    assert!(
        log.matches("redis sentinel: connected to the master")
            .count()
            >= 2,
        "{log}"
    );
}

/// The master's password (`requirepass`) and the sentinels' own, both from
/// the environment: the fast path authenticates to each, and neither
/// password reaches the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_and_master_passwords_come_from_the_environment() {
    require_postgres(&database_url()).await;
    let auth = Auth {
        master: "m4ster-secret".into(),
        sentinel: "sent1nel-secret".into(),
    };
    let set = SentinelSet::start_with_auth(auth.clone());
    assert!(
        !set.answers_without_password(),
        "the passwords are not required"
    );
    let up = Upstream::start().await;
    let schema = TestSchema::new();
    let dir = tempfile::TempDir::new().expect("tempdir");
    let config = dir.path().join("idemgate.toml");
    let env = [
        ("IDEMGATE_REDIS_PASSWORD", auth.master.as_str()),
        ("IDEMGATE_REDIS_SENTINEL_PASSWORD", auth.sentinel.as_str()),
    ];
    let serve = serve(&up, &schema, &set, &config, &env).await;
    let first = serve.post(ORDERS).key("auth-1").body(BODY).send().await;
    assert_eq!(first.status(), 201, "{}", first.text());
    crate::support::wait_for("a replay from the fast path", || async {
        let r = serve.post(ORDERS).key("auth-1").body(BODY).send().await;
        assert!(r.replayed(), "{r:?}");
        (fast_path_hits(&serve).await > 0).then_some(())
    })
    .await;
    let names = set.keys(set.master_port(), &format!("{}:*", schema.prefix));
    assert_eq!(names.len(), 1, "{names:?}");
    assert_eq!(executions(&up, "auth-1"), 1);
    let log = serve.log();
    assert!(
        !log.contains(&auth.master) && !log.contains(&auth.sentinel),
        "{log}"
    );
}

/// `redis.tls = true`: the sentinels and the master speak TLS only
/// (`tls-replication` between them too), with a private CA in
/// `redis.ca_file`. The fast path serves through them, and follows a
/// failover (the master SIGKILLed, the replica promoted) by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_over_tls_serves_and_follows_a_failover() {
    tokio::time::timeout(WHOLE, sentinel_over_tls())
        .await
        .expect("the TLS sentinel test finished in time");
}

async fn sentinel_over_tls() {
    require_postgres(&database_url()).await;
    let mut set = tokio::task::spawn_blocking(SentinelSet::start_tls)
        .await
        .expect("start the TLS sentinel set");
    let up = Upstream::start().await;
    let schema = TestSchema::new();
    let dir = tempfile::TempDir::new().expect("tempdir");
    let config = dir.path().join("idemgate.toml");
    let serve = serve(&up, &schema, &set, &config, &[]).await;
    let replayed_from_redis = |key: &'static str, above: u64| {
        let serve = &serve;
        crate::support::wait_for("a replay from the fast path", move || async move {
            let r = serve.post(ORDERS).key(key).body(BODY).send().await;
            assert_eq!(r.status(), 201, "{}", r.text());
            (r.replayed() && fast_path_hits(serve).await > above).then_some(())
        })
    };
    replayed_from_redis("tls-1", 0).await;
    let check = run_to_completion(
        &["check-config", "--connect", "-c", config.to_str().unwrap()],
        &[],
    )
    .await;
    assert_eq!(check.code, 0, "{}{}", check.stdout, check.stderr);

    let old = set.kill_master();
    tokio::task::block_in_place(|| set.wait_promoted(old));
    let hits = fast_path_hits(&serve).await;
    replayed_from_redis("tls-2", hits).await;
    assert_eq!(executions(&up, "tls-1"), 1);
    assert_eq!(executions(&up, "tls-2"), 1);
    let log = serve.log();
    assert!(
        log.matches("redis sentinel: connected to the master")
            .count()
            >= 2,
        "{log}"
    );
}

/// Review F4: a pinned master was never re-validated, so a proxy cut off
/// with the old master from the sentinels' majority kept answering from
/// its copies (records deleted since among them) until a connection-level
/// error. Here the sentinels name another master while the old one stays
/// up and a master: the fast path moves to it within a couple of seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_the_sentinels_no_longer_name_is_left_within_seconds() {
    use idemgate::config::{RedisConfig, SentinelConfig};
    use idemgate::idempotency::{RecordKey, Scope};
    use idemgate::store::memory::MemoryStore;
    use idemgate::store::redis::RedisFastPath;

    let set = SentinelSet::start();
    let other = crate::support::services::PrivateRedis::start();
    let cfg = RedisConfig {
        url: String::new(),
        timeout: Duration::from_millis(500),
        prefix: "f4".into(),
        cluster: false,
        ca_file: None,
        cert_file: None,
        key_file: None,
        sentinel: Some(SentinelConfig {
            sentinels: set
                .sentinel_addrs()
                .iter()
                .map(|a| {
                    let (host, port) = a.rsplit_once(':').unwrap();
                    (host.to_string(), port.parse().unwrap())
                })
                .collect(),
            master: MASTER_NAME.into(),
            username: None,
            password: None,
            tls: false,
            sentinel_username: None,
            sentinel_password: None,
        }),
    };
    let fast = RedisFastPath::new(Arc::new(MemoryStore::new()), &cfg)
        .await
        .unwrap();
    let key = RecordKey {
        scope: Scope([1; 32]),
        key: [2; 32],
    };
    let old = fast.redis_name(&key).await.unwrap();
    let old_epoch = epoch_of(&old, "f4").to_string();

    let old_port = set.master_port();
    let other_port: u16 = other.url().rsplit(':').next().unwrap().parse().unwrap();
    set.monitor_instead(other_port);
    let moved = Instant::now();
    loop {
        let now = fast.redis_name(&key).await.unwrap();
        if epoch_of(&now, "f4") != old_epoch {
            break;
        }
        assert!(
            moved.elapsed() < Duration::from_secs(4),
            "the fast path still uses the master the sentinels no longer name ({old})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "fast path on the new master {:?} after the sentinels named it",
        moved.elapsed()
    );
    assert_eq!(
        set.role(old_port).as_deref(),
        Some("master"),
        "the old master stayed up, a master"
    );
}
