//! The Redis fast path on one node at a fixed address (`redis.url`), as a
//! managed primary endpoint (ElastiCache, Memorystore, Azure) fails over:
//! a private master and replica (`REPLICAOF`), the real binary reaching
//! them through a TCP relay (the endpoint), the replica promoted and the
//! relay repointed at it. The promoted replica still holds the copy of a
//! record PostgreSQL deleted (the `DEL` never reached it): it is never
//! replayed, because key names carry the master's epoch
//! (`src/store/redis/master.rs`), and the fast path serves from the new
//! master by itself.

use crate::support::fast_path::{
    config_on_postgres, delete_key, epoch_of, executions, fast_path_hits,
};
use crate::support::services::{database_url, require_postgres, PrivateRedis, TcpRelay};
use crate::support::{ServeProcess, TestSchema, Upstream, ORDERS};
use std::time::Duration;

const BODY: &str = r#"{"item":"book"}"#;

/// Bounds the whole test: setup, the failover, the checks.
const WHOLE: Duration = Duration::from_secs(60);

fn sync_conn(redis: &PrivateRedis) -> redis::Connection {
    redis::Client::open(redis.url())
        .and_then(|c| c.get_connection())
        .expect("connect to the private redis")
}

fn names(redis: &PrivateRedis, prefix: &str) -> Vec<String> {
    redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query(&mut sync_conn(redis))
        .expect("KEYS")
}

fn info_replication(redis: &PrivateRedis) -> String {
    redis::cmd("INFO")
        .arg("replication")
        .query(&mut sync_conn(redis))
        .expect("INFO")
}

/// Sends `key` until the fast path answers it from Redis (a replay and a
/// hit more than `hits`).
async fn until_served_from_redis(serve: &ServeProcess, key: &str, hits: u64) {
    crate::support::wait_for("a replay from the fast path", || async {
        let r = serve.post(ORDERS).key(key).body(BODY).send().await;
        assert_eq!(r.status(), 201, "{}", r.text());
        (r.replayed() && fast_path_hits(serve).await > hits).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_behind_a_fixed_redis_address_never_replays_a_deleted_record() {
    tokio::time::timeout(WHOLE, failover_behind_the_endpoint())
        .await
        .expect("the endpoint failover test finished in time");
}

async fn failover_behind_the_endpoint() {
    require_postgres(&database_url()).await;
    let mut master = PrivateRedis::start();
    let replica = PrivateRedis::start();
    // No RDB file in the working directory: the master streams its full
    // sync, and the replica loads it without writing it out.
    for (server, name, value) in [
        (&master, "repl-diskless-sync", "yes"),
        (&master, "repl-diskless-sync-delay", "0"),
        (&replica, "repl-diskless-load", "on-empty-db"),
    ] {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query(&mut sync_conn(server))
            .expect("CONFIG SET");
    }
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(master.addr().port())
        .query(&mut sync_conn(&replica))
        .expect("REPLICAOF");
    crate::support::wait_for("the replica in sync", || async {
        info_replication(&replica)
            .contains("master_link_status:up")
            .then_some(())
    })
    .await;
    let endpoint = TcpRelay::start(master.addr()).await;
    let up = Upstream::start().await;
    let schema = TestSchema::new();
    let prefix = schema.prefix.as_str();
    let dir = tempfile::TempDir::new().expect("tempdir");
    let config = dir.path().join("idemgate.toml");
    let (listen, admin) = (crate::support::free_port(), crate::support::free_port());
    config_on_postgres(up.addr, listen, admin, &schema)
        .set("redis.url", format!("redis://{}", endpoint.addr()))
        .set("redis.timeout", "1s")
        .write(&config);
    let serve = ServeProcess::start(&config, listen, admin, &[("RUST_LOG", "info")]).await;

    // 1. A record completed and cached; the replica has its copy.
    let first = serve.post(ORDERS).key("deleted").body(BODY).send().await;
    assert_eq!(first.status(), 201, "{}", first.text());
    until_served_from_redis(&serve, "deleted", 0).await;
    let copy = crate::support::wait_for("the copy on the replica", || async {
        let on_master = names(&master, prefix);
        (on_master.len() == 1 && names(&replica, prefix) == on_master).then(|| on_master[0].clone())
    })
    .await;

    // 2. The replica stops following (a lagging replica about to be
    // promoted), then an operator deletes the record: PostgreSQL's row and
    // the master's copy go, the replica keeps its copy.
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query(&mut sync_conn(&replica))
        .expect("REPLICAOF NO ONE");
    delete_key(&config, "deleted").await;
    assert!(names(&master, prefix).is_empty());
    assert_eq!(names(&replica, prefix), vec![copy.clone()]);

    // 3. The endpoint moves to the promoted replica; the old master dies.
    endpoint.repoint(replica.addr());
    master.kill();

    // 4. The fast path serves from the new master by itself (another key,
    // cached afresh under the new master's epoch).
    let hits = fast_path_hits(&serve).await;
    let probe = serve.post(ORDERS).key("probe").body(BODY).send().await;
    assert_eq!(probe.status(), 201, "{}", probe.text());
    until_served_from_redis(&serve, "probe", hits).await;

    // 5. The deleted record's stale copy is on the new master: never
    // read, the key runs again. It is under the old master's epoch, the
    // new copies under the new one's.
    let rerun = serve.post(ORDERS).key("deleted").body(BODY).send().await;
    assert_eq!(rerun.status(), 201, "{}", rerun.text());
    assert!(
        !rerun.replayed(),
        "a deleted record replayed from a stale copy"
    );
    assert_eq!(executions(&up, "deleted"), 2);
    let on_new = names(&replica, prefix);
    assert!(on_new.contains(&copy), "{on_new:?}");
    let fresh: Vec<&String> = on_new.iter().filter(|n| **n != copy).collect();
    assert!(!fresh.is_empty(), "{on_new:?}");
    for name in fresh {
        assert_ne!(
            epoch_of(name, prefix),
            epoch_of(&copy, prefix),
            "{on_new:?}"
        );
    }
    assert_eq!(executions(&up, "probe"), 1);
    let log = serve.log();
    assert!(
        log.matches("redis: connected to the master").count() >= 2,
        "{log}"
    );
}
