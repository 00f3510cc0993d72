//! The Redis fast path on a Redis Cluster (`redis.cluster = true`), against
//! a private three-node cluster the test starts: fast-path hits match a
//! single node's for the same traffic over keys in every node's slots,
//! `MOVED` never reaches the log, and a node killed during traffic leaves
//! every request answered right, each key executed once, on PostgreSQL. An
//! operator's delete is done only once the shard's replicas have the `DEL`.

use crate::support::fast_path::config_on_postgres;
use crate::support::redis_cluster::RedisCluster;
use crate::support::services::{database_url, require_postgres, PrivateRedis, TestSchema};
use crate::support::{bounded, metric_value, Backend, Proxy, Resp, ServeProcess, Upstream, ORDERS};
use std::collections::HashMap;

const BODY: &str = r#"{"item":"book"}"#;

/// `idemgate serve` (a child process, so its log can be read; `RUST_LOG`
/// at info) on PostgreSQL with the fast path at `redis_url`.
async fn serve(
    up: &Upstream,
    schema: &TestSchema,
    dir: &std::path::Path,
    redis_url: &str,
    cluster: bool,
) -> ServeProcess {
    let (listen, admin) = (crate::support::free_port(), crate::support::free_port());
    let config = dir.join(format!("idemgate-{}.toml", listen.port()));
    config_on_postgres(up.addr, listen, admin, schema)
        .set("redis.url", redis_url)
        .set("redis.cluster", cluster)
        // Generous: a slow first connection must not count as an outage.
        .set("redis.timeout", "2s")
        .write(&config);
    ServeProcess::start(&config, listen, admin, &[("RUST_LOG", "info")]).await
}

/// Stores `n` new keys and replays each once, sequentially; returns the
/// fast path's (hits, misses, errors) as `/metrics` shows them.
async fn store_and_replay(serve: &ServeProcess, tag: &str, n: usize) -> (u64, u64, u64) {
    for i in 0..n {
        let key = format!("{tag}-{i}");
        let first = serve.post(ORDERS).key(&key).body(BODY).send().await;
        assert_eq!(first.status(), 201, "{}", first.text());
        assert!(!first.replayed());
        let replay = serve.post(ORDERS).key(&key).body(BODY).send().await;
        assert!(replay.replayed(), "{replay:?}");
        assert_eq!(replay.body, first.body);
    }
    let metrics = serve.admin_get("/metrics").send().await.text();
    let m = |name: &str| metric_value(&metrics, &format!("idemgate_redis_fast_path_{name}_total"));
    (m("hits"), m("misses"), m("errors"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_path_hits_on_a_cluster_match_a_single_node_and_moved_is_never_logged() {
    require_postgres(&database_url()).await;
    let cluster = RedisCluster::start(3);
    let single = PrivateRedis::start();
    let up = Upstream::start().await;
    let dir = tempfile::TempDir::new().expect("tempdir");
    let keys = 60;

    let schema = TestSchema::new();
    let on_cluster = serve(&up, &schema, dir.path(), &cluster.url(), true).await;
    let cluster_counts = store_and_replay(&on_cluster, "c", keys).await;
    let single_schema = TestSchema::new();
    let on_single = serve(&up, &single_schema, dir.path(), &single.url(), false).await;
    let single_counts = store_and_replay(&on_single, "s", keys).await;

    // Each first request is a miss (the lock goes in, PostgreSQL decides),
    // each replay a hit, on either.
    assert_eq!(single_counts, (keys as u64, keys as u64, 0));
    assert_eq!(cluster_counts, single_counts);
    // The keys really spread over the three primaries.
    for node in 0..3 {
        assert!(cluster.keys_on(node) > 0, "node {node} holds no key");
    }
    let log = on_cluster.log();
    assert!(!log.to_ascii_uppercase().contains("MOVED"), "{log}");
    assert!(log.contains("redis cluster fast path connected"), "{log}");
    assert_eq!(up.hits(ORDERS), 2 * keys);
}

/// Pins (issue 11): a Redis Cluster named without `redis.cluster = true`
/// gave one `MOVED` warning per request (42 for 40 requests) and almost no
/// fast-path hits. Now the misconfiguration is named once, and requests
/// keep being answered right (PostgreSQL decides while the fast path steps
/// aside).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_named_without_cluster_true_is_reported_once_not_per_request() {
    require_postgres(&database_url()).await;
    let cluster = RedisCluster::start(3);
    let up = Upstream::start().await;
    let dir = tempfile::TempDir::new().expect("tempdir");
    let schema = TestSchema::new();
    let serve = serve(&up, &schema, dir.path(), &cluster.url(), false).await;
    store_and_replay(&serve, "m", 20).await;
    let log = serve.log();
    assert_eq!(log.matches("set redis.cluster = true").count(), 1, "{log}");
    // At most one outage line per backoff second, never one per request.
    let noisy = log
        .lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR"))
        .count();
    assert!(noisy <= 6, "{noisy} warnings for 40 requests:\n{log}");
    assert_eq!(up.hits(ORDERS), 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_during_traffic_falls_back_to_postgres_and_every_key_runs_once() {
    let mut cluster = RedisCluster::start(3);
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::PostgresRedis, up.addr)
        .redis_url(&cluster.url())
        .set("redis.cluster", true)
        .start()
        .await;

    // Before: stored keys replay from the cluster.
    let mut stored = HashMap::new();
    for i in 0..20 {
        let key = format!("before-{i}");
        let first = proxy.post(ORDERS).key(&key).body(BODY).send().await;
        assert_eq!(first.status(), 201, "{}", first.text());
        let replay = proxy.post(ORDERS).key(&key).body(BODY).send().await;
        assert!(replay.replayed());
        stored.insert(key, first.body);
    }
    assert!(proxy.fast_path_hits() >= 20, "{}", proxy.metrics.encode());

    // During: duplicates of new keys, two at a time; a primary dies after
    // the first round.
    let keys: Vec<String> = (0..30).map(|i| format!("during-{i}")).collect();
    let mut answers: HashMap<String, Vec<Resp>> = HashMap::new();
    for round in 0..4 {
        if round == 1 {
            cluster.kill(1);
        }
        let sends: Vec<_> = keys
            .iter()
            .flat_map(|k| [k.clone(), k.clone()])
            .map(|k| {
                let req = proxy.post(ORDERS).key(&k).body(BODY);
                (k, tokio::spawn(req.send()))
            })
            .collect();
        for (key, send) in sends {
            let r = bounded("a request during the kill", send)
                .await
                .expect("request task");
            answers.entry(key).or_default().push(r);
        }
    }
    assert!(proxy.fast_path_errors() > 0, "{}", proxy.metrics.encode());

    // After: every key answers its one execution.
    for key in &keys {
        let r = proxy.post(ORDERS).key(key).body(BODY).send().await;
        assert!(r.replayed(), "{key}: {r:?}");
        answers.entry(key.clone()).or_default().push(r);
    }
    for (key, body) in &stored {
        let r = proxy.post(ORDERS).key(key).body(BODY).send().await;
        assert!(r.replayed(), "{key}: {r:?}");
        assert_eq!(&r.body, body, "{key}");
    }
    let seen = up.seen();
    for (key, rs) in &answers {
        let executions = seen
            .iter()
            .filter(|s| {
                s.headers
                    .get("idempotency-key")
                    .is_some_and(|v| v == key.as_str())
            })
            .count();
        assert_eq!(executions, 1, "{key} ran {executions} times");
        let ok: Vec<&Resp> = rs.iter().filter(|r| r.status() == 201).collect();
        assert!(ok.iter().all(|r| r.body == ok[0].body), "{key}: {rs:?}");
        for r in rs.iter().filter(|r| r.status() != 201) {
            // A duplicate that met its twin in flight.
            r.assert_problem(409);
        }
    }
    assert_eq!(up.hits(ORDERS), 20 + keys.len());
}

/// A cluster over TLS (client and bus), its nodes announcing the host name
/// their certificate carries, as managed clusters do: `rediss://` with
/// `ca_file` and `cluster = true` gets fast-path hits on every node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_cluster_gets_fast_path_hits_through_the_ca_file() {
    let cluster = RedisCluster::start_tls(3);
    let up = Upstream::start().await;
    let ca = cluster.pki.as_ref().expect("a TLS cluster").ca();
    let proxy = Proxy::builder(Backend::PostgresRedis, up.addr)
        .redis_url(&cluster.url())
        .set("redis.cluster", true)
        .set("redis.ca_file", ca.as_str())
        .set("redis.timeout", "2s")
        .start()
        .await;
    let keys = 30;
    for i in 0..keys {
        let key = format!("tls-{i}");
        let first = proxy.post(ORDERS).key(&key).body(BODY).send().await;
        assert_eq!(first.status(), 201, "{}", first.text());
        let replay = proxy.post(ORDERS).key(&key).body(BODY).send().await;
        assert!(replay.replayed(), "{replay:?}");
    }
    assert_eq!(proxy.fast_path_hits(), keys, "{}", proxy.metrics.encode());
    assert_eq!(proxy.fast_path_errors(), 0, "{}", proxy.metrics.encode());
    for node in 0..3 {
        assert!(cluster.keys_on(node) > 0, "node {node} holds no key");
    }
}

/// A primary killed with a replica behind it: while the replica takes
/// over, requests are answered on PostgreSQL (each key executed once);
/// once the cluster is whole again the fast path answers again, without a
/// restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failover_to_a_replica_the_fast_path_resumes_and_every_key_ran_once() {
    let mut cluster = RedisCluster::start_with_replicas(3, 1);
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::PostgresRedis, up.addr)
        .redis_url(&cluster.url())
        .set("redis.cluster", true)
        .start()
        .await;
    let keys: Vec<String> = (0..20).map(|i| format!("fo-{i}")).collect();
    let mut answers: HashMap<String, Vec<Resp>> = HashMap::new();
    // Sequential rounds: a key's earlier answers are in before it is sent
    // again, so a replay is due on every later round.
    for round in 0..3 {
        if round == 1 {
            cluster.kill_a_replicated_primary();
        }
        let sends: Vec<_> = keys
            .iter()
            .map(|k| {
                (
                    k.clone(),
                    tokio::spawn(proxy.post(ORDERS).key(k).body(BODY).send()),
                )
            })
            .collect();
        for (key, send) in sends {
            let r = bounded("a request during the failover", send)
                .await
                .expect("request task");
            answers.entry(key).or_default().push(r);
        }
    }
    cluster.wait_ok(std::time::Duration::from_secs(15));

    // The fast path answers again: a new key stored now replays from Redis.
    let hits_before = proxy.fast_path_hits();
    crate::support::wait_for("fast-path hits after the failover", || async {
        let key = format!("after-{}", rand::random::<u32>());
        let first = proxy.post(ORDERS).key(&key).body(BODY).send().await;
        assert_eq!(first.status(), 201, "{}", first.text());
        let replay = proxy.post(ORDERS).key(&key).body(BODY).send().await;
        assert!(replay.replayed(), "{replay:?}");
        (proxy.fast_path_hits() > hits_before).then_some(())
    })
    .await;

    let seen = up.seen();
    for (key, rs) in &answers {
        let executions = seen
            .iter()
            .filter(|s| {
                s.headers
                    .get("idempotency-key")
                    .is_some_and(|v| v == key.as_str())
            })
            .count();
        assert_eq!(executions, 1, "{key} ran {executions} times");
        let ok: Vec<&Resp> = rs.iter().filter(|r| r.status() == 201).collect();
        assert!(!ok.is_empty(), "{key}: {rs:?}");
        assert!(ok.iter().all(|r| r.body == ok[0].body), "{key}: {rs:?}");
        for r in rs.iter().filter(|r| r.status() != 201) {
            r.assert_problem(409);
        }
    }
}

/// Issue 20: a cluster's key names carry no epoch, so a copy an operator
/// deleted (`keys delete`, `keys resolve`) whose `DEL` a lagging replica
/// missed would be replayed after that replica's promotion. The delete
/// now waits (`WAIT`) for every replica of the copy's shard: with the
/// replicas held back it reports the copy it could not be sure of (exit
/// non-zero, naming it), where it used to say "deleted"; once they run
/// again, the delete goes through and the key runs anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_on_a_cluster_is_reported_until_the_shards_replicas_have_the_del() {
    require_postgres(&database_url()).await;
    let cluster = RedisCluster::start_with_replicas(3, 1);
    let up = Upstream::start().await;
    let dir = tempfile::TempDir::new().expect("tempdir");
    let schema = TestSchema::new();
    let gate = serve(&up, &schema, dir.path(), &cluster.url(), true).await;
    let config = dir
        .path()
        .join(format!("idemgate-{}.toml", gate.listen.port()));
    let first = gate.post(ORDERS).key("del-1").body(BODY).send().await;
    assert_eq!(first.status(), 201, "{}", first.text());
    let replay = gate.post(ORDERS).key("del-1").body(BODY).send().await;
    assert!(replay.replayed(), "{replay:?}");
    let delete = || async {
        let config = config.to_str().expect("utf-8 path");
        crate::support::run_to_completion(
            &["keys", "--config", config, "delete", "--anonymous", "del-1"],
            &[],
        )
        .await
    };

    assert_eq!(cluster.hold_replicas(Some(20_000)), 3);
    let held = delete().await;
    cluster.hold_replicas(None);
    let said = format!("{}{}", held.stdout, held.stderr);
    assert_ne!(held.code, 0, "{said}");
    assert!(
        said.contains("could not be removed") && said.contains("acknowledged the DEL"),
        "{said}"
    );

    // The replicas run again: the delete (again) goes through.
    let again = delete().await;
    assert_eq!(again.code, 0, "{}{}", again.stdout, again.stderr);
    let rerun = gate.post(ORDERS).key("del-1").body(BODY).send().await;
    assert_eq!(rerun.status(), 201, "{}", rerun.text());
    assert!(!rerun.replayed(), "ran anew after the delete");
    assert_eq!(up.hits(ORDERS), 2);
}
