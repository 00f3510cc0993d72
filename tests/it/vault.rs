//! Stored responses sealed at rest (issue 21,
//! `IDEMGATE_STORE_ENCRYPTION_KEYS`), through the real binary on SQLite,
//! PostgreSQL and PostgreSQL + Redis: no byte run of a response is in the
//! file, the rows or the Redis values; replays stay byte-identical; every
//! listed key opens (rotation); a record under a key no longer listed is
//! never executed again (410); `keys reencrypt` moves every record to the
//! new key, Redis copies included, so the old key can go.

use crate::support::services::{
    database_url, drop_schema, redis_url, require_postgres, require_redis, unique_schema,
};
use crate::support::{
    free_port, run_to_completion, Resp, Route, ServeProcess, TestConfig, Upstream, ORDERS,
};
use base64::Engine;
use std::path::Path;

const OLD: u8 = 0x11;
const NEW: u8 = 0x22;

fn key(id: &str, byte: u8) -> String {
    format!(
        "{id}:{}",
        base64::engine::general_purpose::STANDARD.encode([byte; 32])
    )
}

/// 4096 bytes of `x` (the test upstream's `size=`): a run no ciphertext has.
const TARGET: &str = "/orders?size=4096";
const RUN: &[u8] = b"xxxxxxxxxxxxxxxxxxxxxxxx";

fn holds_run(bytes: &[u8]) -> bool {
    bytes.windows(RUN.len()).any(|w| w == RUN)
}

/// Ends `gate` and waits for it to exit, so the next one can take its ports.
async fn stop(mut gate: ServeProcess) {
    gate.terminate();
    gate.exited().await;
}

/// `idemgate serve` on `config` with `keys` as its encryption keys.
async fn serve_with_keys(
    config: &Path,
    listen: std::net::SocketAddr,
    admin: std::net::SocketAddr,
    keys: String,
) -> ServeProcess {
    let env = [("IDEMGATE_STORE_ENCRYPTION_KEYS", keys.as_str())];
    ServeProcess::start(config, listen, admin, &env).await
}

/// Stores one response under `old`, replays it under `old`, then under
/// `new,old` (rotation: both open), then under `new` alone (its key gone:
/// 410, not run again); `stored` returns every byte the store keeps.
async fn sealed_at_rest<F, Fut>(store: impl Fn(TestConfig, &Path) -> TestConfig, stored: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Vec<Vec<u8>>>,
{
    let up = Upstream::start().await;
    let dir = tempfile::TempDir::new().expect("tempdir");
    let config = dir.path().join("idemgate.toml");
    let (listen, admin) = (free_port(), free_port());
    store(
        TestConfig::new(up.addr)
            .listen(listen, admin)
            .route(Route::post(ORDERS)),
        dir.path(),
    )
    .write(&config);
    let serve = |keys: String| serve_with_keys(&config, listen, admin, keys);
    let send = |gate: &ServeProcess| gate.post(TARGET).key("k-vault").body("{}").send();

    let gate = serve(key("old", OLD)).await;
    let first = send(&gate).await;
    assert_eq!(first.status(), 201, "{}", first.text());
    assert!(holds_run(&first.body));
    let replay = send(&gate).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body, "byte for byte");
    assert_eq!(replay.header("location"), first.header("location"));
    let kept = stored().await;
    assert!(!kept.is_empty(), "the store holds the record");
    assert!(
        !kept.iter().any(|b| holds_run(b)),
        "a byte run of the response is stored in plaintext"
    );
    stop(gate).await;

    // Rotation: a new key first, the old one still listed, opens it.
    let gate = serve(format!("{},{}", key("new", NEW), key("old", OLD))).await;
    let rotated = send(&gate).await;
    assert!(rotated.replayed(), "{}", rotated.text());
    assert_eq!(rotated.body, first.body);
    stop(gate).await;

    // The old key removed: never executed again.
    let gate = serve(key("new", NEW)).await;
    let gone = send(&gate).await;
    assert_eq!(gone.status(), 410, "{}", gone.text());
    assert_eq!(up.hits(ORDERS), 1, "the upstream ran it once in all");
    let metrics = gate.admin_get("/metrics").send().await.text();
    assert!(
        metrics.contains("idemgate_sealed_unreadable_total{reason=\"unknown_key\"} 1"),
        "{metrics}"
    );
}

/// Responses stored under `old`; `keys reencrypt` (pages of 2) run beside
/// a proxy with `new,old` that serves traffic meanwhile (replays of those
/// keys, new keys stored); then under `new` alone every one replays byte
/// for byte (none 410), never run again.
async fn reencrypted(store: impl Fn(TestConfig) -> TestConfig) {
    let up = Upstream::start().await;
    let dir = tempfile::TempDir::new().expect("tempdir");
    let config = dir.path().join("idemgate.toml");
    let (listen, admin) = (free_port(), free_port());
    store(
        TestConfig::new(up.addr)
            .listen(listen, admin)
            .route(Route::post(ORDERS)),
    )
    .write(&config);
    let serve = |keys: String| serve_with_keys(&config, listen, admin, keys);
    let keys = ["k-re-1", "k-re-2", "k-re-3", "k-re-4", "k-re-5"];
    let send = |gate: &ServeProcess, k: &'static str| gate.post(TARGET).key(k).body("{}").send();

    let gate = serve(key("old", OLD)).await;
    let mut first = Vec::new();
    for k in keys {
        let resp = send(&gate, k).await;
        assert_eq!(resp.status(), 201, "{}", resp.text());
        // Replayed once: a fast path in front now holds a copy under `old`.
        assert!(send(&gate, k).await.replayed());
        first.push(resp);
    }
    stop(gate).await;

    let config_arg = config.display().to_string();
    let args = ["keys", "--config", &config_arg, "reencrypt", "--batch", "2"];
    let unset = run_to_completion(&args, &[]).await;
    assert_eq!(unset.code, 1, "{unset:?}");
    assert!(
        unset
            .stderr
            .contains("IDEMGATE_STORE_ENCRYPTION_KEYS is not set"),
        "{unset:?}"
    );

    let both = format!("{},{}", key("new", NEW), key("old", OLD));
    let env = [("IDEMGATE_STORE_ENCRYPTION_KEYS", both.as_str())];
    let check = ["check-config", "--connect", "-c", &config_arg];
    let census = run_to_completion(&check, &env).await;
    assert_eq!(census.code, 0, "{census:?}");
    assert!(
        census
            .stdout
            .contains("all 5 live stored responses: by configured key id: old 5;"),
        "{census:?}"
    );
    let gate = serve(both.clone()).await;
    // Traffic while it runs: the old keys replay (under either key), new
    // keys are stored (under `new`) and may be scanned as current.
    const LIVE: usize = 20;
    let traffic = async {
        let mut live = Vec::new();
        for i in 0..LIVE {
            let replay = send(&gate, keys[i % keys.len()]).await;
            assert!(replay.replayed(), "during the rotation: {}", replay.text());
            assert_eq!(replay.body, first[i % keys.len()].body);
            let k: &'static str = Box::leak(format!("k-live-{i}").into_boxed_str());
            let fresh = send(&gate, k).await;
            assert_eq!(fresh.status(), 201, "{}", fresh.text());
            live.push((k, fresh));
        }
        live
    };
    let (run, live) = tokio::join!(run_to_completion(&args, &env), traffic);
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.contains("done: 5 rewritten,"), "{run:?}");
    assert!(
        run.stdout.contains("reencrypt: scanned 2, "),
        "pages of 2: {run:?}"
    );
    let again = run_to_completion(&args, &env).await;
    assert!(
        again
            .stdout
            .contains(&format!("done: 0 rewritten, {} already current", 5 + LIVE)),
        "{again:?}"
    );
    stop(gate).await;

    let gate = serve(key("new", NEW)).await;
    for (k, first) in keys.into_iter().zip(&first) {
        let replay = send(&gate, k).await;
        assert!(
            replay.replayed(),
            "{k}: {} {}",
            replay.status(),
            replay.text()
        );
        assert_eq!(replay.body, first.body, "{k}: byte for byte");
        assert_eq!(replay.header("location"), first.header("location"));
    }
    for (k, fresh) in &live {
        let replay = send(&gate, k).await;
        assert!(replay.replayed(), "{k}: {}", replay.text());
        assert_eq!(replay.body, fresh.body);
    }
    assert_eq!(up.hits(ORDERS), keys.len() + LIVE, "each ran once");
    stop(gate).await;
}

fn on_postgres(c: TestConfig, url: &str, schema: &str) -> TestConfig {
    c.set("store.backend", "postgres")
        .set("store.url", url)
        .set("store.schema", schema)
        .set("store.pool_size", 4)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reencrypt_moves_every_record_to_the_new_key_on_sqlite() {
    let dir = tempfile::TempDir::new().expect("tempdir");
    let db = dir.path().join("re.db").display().to_string();
    reencrypted(|c| {
        c.set("store.backend", "sqlite")
            .set("store.path", db.as_str())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reencrypt_moves_every_record_to_the_new_key_on_postgres() {
    let url = database_url();
    require_postgres(&url).await;
    let schema = unique_schema("reenc");
    reencrypted(|c| on_postgres(c, &url, &schema)).await;
    drop_schema(&url, &schema).await;
}

/// The Redis copies of the records, cached under `old`, are dropped by the
/// rewrite: under `new` alone none answers 410.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reencrypt_moves_every_record_to_the_new_key_in_postgres_and_redis() {
    let url = database_url();
    require_postgres(&url).await;
    let redis = redis_url();
    require_redis(&redis);
    let schema = unique_schema("reenc_redis");
    reencrypted(|c| {
        on_postgres(c, &url, &schema)
            .set("redis.url", redis.as_str())
            .set("redis.prefix", schema.as_str())
    })
    .await;
    drop_schema(&url, &schema).await;
    drop_redis_keys(&redis, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_are_sealed_at_rest_on_sqlite() {
    let dir = tempfile::TempDir::new().expect("tempdir");
    let db_dir = dir.path().to_path_buf();
    sealed_at_rest(
        |c, _| {
            c.set("store.backend", "sqlite")
                .set("store.path", db_dir.join("v.db").display().to_string())
        },
        || async {
            // The database and its WAL: everything SQLite wrote.
            std::fs::read_dir(&db_dir)
                .expect("db dir")
                .map(|e| std::fs::read(e.expect("entry").path()).expect("read"))
                .collect()
        },
    )
    .await;
}

/// A client of the test database, and its connection's task.
async fn pg(url: &str) -> (tokio_postgres::Client, tokio::task::JoinHandle<()>) {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    (client, tokio::spawn(async move { drop(conn.await) }))
}

async fn rows(url: &str, schema: &str) -> Vec<Vec<u8>> {
    let (client, task) = pg(url).await;
    let sql = format!(
        "SELECT coalesce(headers, ''::bytea) || coalesce(body, ''::bytea) FROM {schema}.idempotency_records"
    );
    let out = client
        .query(&sql, &[])
        .await
        .expect("select")
        .iter()
        .map(|r| r.get::<_, Vec<u8>>(0))
        .collect();
    drop(client);
    let _ = task.await;
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_are_sealed_at_rest_on_postgres() {
    let url = database_url();
    require_postgres(&url).await;
    let schema = unique_schema("vault");
    sealed_at_rest(|c, _| on_postgres(c, &url, &schema), || rows(&url, &schema)).await;
    drop_schema(&url, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_are_sealed_at_rest_in_postgres_and_redis() {
    let url = database_url();
    require_postgres(&url).await;
    let redis = redis_url();
    require_redis(&redis);
    let schema = unique_schema("vault_redis");
    let prefix = schema.clone();
    let values = || async {
        let (mut conn, names) = redis_names(&redis, &prefix).await;
        assert!(!names.is_empty(), "the fast path keeps a copy");
        let mut out = rows(&url, &schema).await;
        for name in names {
            let v: Vec<u8> = redis::cmd("GET")
                .arg(&name)
                .query_async(&mut conn)
                .await
                .expect("get");
            out.push(v);
        }
        out
    };
    sealed_at_rest(
        |c, _| {
            on_postgres(c, &url, &schema)
                .set("redis.url", redis.as_str())
                .set("redis.prefix", prefix.as_str())
        },
        values,
    )
    .await;
    drop_schema(&url, &schema).await;
    drop_redis_keys(&redis, &prefix).await;
}

/// A connection to `redis`, and the names it holds under `prefix`.
async fn redis_names(
    redis: &str,
    prefix: &str,
) -> (redis::aio::MultiplexedConnection, Vec<String>) {
    let client = redis::Client::open(redis).expect("redis url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("redis");
    let names = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query_async(&mut conn)
        .await
        .expect("keys");
    (conn, names)
}

/// Deletes what a test's fast path left under `prefix`.
async fn drop_redis_keys(redis: &str, prefix: &str) {
    let (mut conn, names) = redis_names(redis, prefix).await;
    if !names.is_empty() {
        let _: () = redis::cmd("DEL")
            .arg(&names)
            .query_async(&mut conn)
            .await
            .expect("del");
    }
}

async fn execute(url: &str, sql: &str) -> u64 {
    let (client, task) = pg(url).await;
    let n = client.execute(sql, &[]).await.expect(sql);
    drop(client);
    let _ = task.await;
    n
}

/// Three responses stored under one key (and replayed once, so a fast
/// path in front holds a copy of each); then `alter` flips one byte of
/// `k-tampered`'s ciphertext and copies `k-source`'s over `k-moved`'s,
/// wherever the store keeps them: those two answer 410 and the upstream
/// is not called again; the untouched one replays.
async fn tampered_and_moved<F, Fut>(store: impl Fn(TestConfig) -> TestConfig, alter: F)
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let up = Upstream::start().await;
    let dir = tempfile::TempDir::new().expect("tempdir");
    let config = dir.path().join("idemgate.toml");
    let (listen, admin) = (free_port(), free_port());
    store(
        TestConfig::new(up.addr)
            .listen(listen, admin)
            .route(Route::post(ORDERS)),
    )
    .write(&config);
    let gate = serve_with_keys(&config, listen, admin, key("k1", OLD)).await;
    let send = |k: &'static str| gate.post(TARGET).key(k).body("{}").send();
    for k in ["k-tampered", "k-moved", "k-source"] {
        assert_eq!(send(k).await.status(), 201);
        assert!(send(k).await.replayed());
    }
    alter().await;
    for k in ["k-tampered", "k-moved"] {
        let retry = send(k).await;
        assert_eq!(retry.status(), 410, "{k}: {}", retry.text());
    }
    assert!(
        send("k-source").await.replayed(),
        "the untouched record replays"
    );
    assert_eq!(up.hits(ORDERS), 3, "nothing ran again");
    let metrics = gate.admin_get("/metrics").send().await.text();
    assert!(
        metrics.contains("idemgate_sealed_unreadable_total{reason=\"forged\"} 2"),
        "{metrics}"
    );
    stop(gate).await;
}

/// One byte of `k-tampered`'s body flipped, and `k-source`'s body and
/// headers copied over `k-moved`'s, in the PostgreSQL rows.
async fn tamper_and_move_rows(url: &str, schema: &str) {
    let (tampered, source) = (hex_key("k-tampered"), hex_key("k-source"));
    let flipped = execute(
        url,
        &format!(
            "UPDATE {schema}.idempotency_records SET body = overlay(body placing \
         decode(lpad(to_hex(get_byte(body, 40) # 1), 2, '0'), 'hex') from 41 for 1) \
         WHERE key = decode('{tampered}', 'hex')"
        ),
    )
    .await;
    assert_eq!(flipped, 1);
    let moved = execute(
        url,
        &format!(
            "UPDATE {schema}.idempotency_records AS r SET body = s.body, headers = s.headers \
         FROM {schema}.idempotency_records AS s \
         WHERE s.key = decode('{source}', 'hex') AND r.key = decode('{}', 'hex')",
            hex_key("k-moved")
        ),
    )
    .await;
    assert_eq!(moved, 1);
}

/// Through the binary on PostgreSQL: a sealed response altered in its row,
/// or copied over another record's, never opens there: those keys answer
/// 410 and the upstream is not called again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_or_moved_sealed_response_is_never_replayed_or_run_again() {
    let url = database_url();
    require_postgres(&url).await;
    let schema = unique_schema("vault_tamper");
    tampered_and_moved(
        |c| on_postgres(c, &url, &schema),
        || tamper_and_move_rows(&url, &schema),
    )
    .await;
    drop_schema(&url, &schema).await;
}

/// The same in the SQLite file, altered by another connection while the
/// proxy runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_or_moved_sealed_response_on_sqlite_is_never_replayed_or_run_again() {
    let dir = tempfile::TempDir::new().expect("tempdir");
    let db = dir.path().join("tamper.db");
    let alter = || async {
        let file = rusqlite::Connection::open(&db).expect("open the database");
        file.busy_timeout(std::time::Duration::from_secs(5))
            .expect("busy timeout");
        let body_of = |k: &str| -> Vec<u8> {
            file.query_row(
                "SELECT body FROM idempotency_records WHERE key = ?1",
                [hex::decode(hex_key(k)).expect("hex")],
                |row| row.get(0),
            )
            .expect("the record's row")
        };
        let mut tampered = body_of("k-tampered");
        tampered[40] ^= 1;
        let flipped = file
            .execute(
                "UPDATE idempotency_records SET body = ?1 WHERE key = ?2",
                rusqlite::params![tampered, hex::decode(hex_key("k-tampered")).expect("hex")],
            )
            .expect("flip");
        assert_eq!(flipped, 1);
        let moved = file
            .execute(
                "UPDATE idempotency_records SET (body, headers) = \
                 (SELECT body, headers FROM idempotency_records WHERE key = ?1) WHERE key = ?2",
                rusqlite::params![
                    hex::decode(hex_key("k-source")).expect("hex"),
                    hex::decode(hex_key("k-moved")).expect("hex")
                ],
            )
            .expect("move");
        assert_eq!(moved, 1);
    };
    tampered_and_moved(
        |c| {
            c.set("store.backend", "sqlite")
                .set("store.path", db.display().to_string())
        },
        alter,
    )
    .await;
}

/// Behind the Redis fast path, with both copies altered (the Redis value
/// and the PostgreSQL row): no copy opens, so 410, never run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_or_moved_sealed_response_in_postgres_and_redis_is_never_replayed_or_run_again()
{
    let url = database_url();
    require_postgres(&url).await;
    let redis = redis_url();
    require_redis(&redis);
    let schema = unique_schema("vault_tamper_redis");
    let alter = || async {
        tamper_and_move_rows(&url, &schema).await;
        let mut values = redis_values(&redis, &schema).await;
        values.flip("k-tampered").await;
        let source = values.get("k-source").await;
        values.set("k-moved", source).await;
    };
    tampered_and_moved(
        |c| {
            on_postgres(c, &url, &schema)
                .set("redis.url", redis.as_str())
                .set("redis.prefix", schema.as_str())
        },
        alter,
    )
    .await;
    drop_schema(&url, &schema).await;
    drop_redis_keys(&redis, &schema).await;
}

/// The Redis values of one test's records, by idempotency key.
struct RedisValues {
    conn: redis::aio::MultiplexedConnection,
    names: Vec<String>,
}

async fn redis_values(redis: &str, prefix: &str) -> RedisValues {
    let (conn, names) = redis_names(redis, prefix).await;
    RedisValues { conn, names }
}

impl RedisValues {
    /// The name of `k`'s value (its key digest ends it).
    fn name(&self, k: &str) -> String {
        let digest = hex_key(k);
        let name = self.names.iter().find(|n| n.ends_with(&digest));
        name.unwrap_or_else(|| panic!("no Redis copy of {k}: {:?}", self.names))
            .clone()
    }

    async fn get(&mut self, k: &str) -> Vec<u8> {
        redis::cmd("GET")
            .arg(self.name(k))
            .query_async(&mut self.conn)
            .await
            .expect("get")
    }

    /// Sets `k`'s value, keeping its expiry.
    async fn set(&mut self, k: &str, value: Vec<u8>) {
        let _: () = redis::cmd("SET")
            .arg(self.name(k))
            .arg(value)
            .arg("KEEPTTL")
            .query_async(&mut self.conn)
            .await
            .expect("set");
    }

    /// Flips the last byte of `k`'s value (the body's, sealed: its tag).
    async fn flip(&mut self, k: &str) {
        let mut value = self.get(k).await;
        *value.last_mut().expect("a value") ^= 1;
        self.set(k, value).await;
    }
}

/// Never a refusal while a readable copy exists: records stored under
/// `old` and replayed (so Redis holds copies under `old`); `keys
/// reencrypt` run with a Redis that does not answer rewrites them in
/// PostgreSQL (exit 0, no copy to `DEL` by hand) and leaves the copies as
/// they were; one is then altered. Under `new` alone both copies fail to
/// open, and each key replays PostgreSQL's copy byte for byte, never run
/// again, none 410 and nothing counted unreadable; the copies are
/// replaced by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_copy_that_does_not_open_gives_way_to_the_postgres_copy() {
    let url = database_url();
    require_postgres(&url).await;
    let redis = redis_url();
    require_redis(&redis);
    let schema = unique_schema("vault_fallback");
    let up = Upstream::start().await;
    let dir = tempfile::TempDir::new().expect("tempdir");
    let (listen, admin) = (free_port(), free_port());
    let with_redis = |c: TestConfig, redis: &str| {
        on_postgres(c, &url, &schema)
            .set("redis.url", redis)
            .set("redis.prefix", schema.as_str())
    };
    let base = || {
        TestConfig::new(up.addr)
            .listen(listen, admin)
            .route(Route::post(ORDERS))
    };
    let config = dir.path().join("idemgate.toml");
    with_redis(base(), &redis).write(&config);
    // Nothing listens there: the rewrite cannot drop the copies.
    let away = dir.path().join("redis-away.toml");
    let nowhere = format!("redis://{}", free_port());
    with_redis(base(), &nowhere)
        .set("redis.timeout", "200ms")
        .write(&away);
    let keys = ["k-removed", "k-tampered"];
    let send = |gate: &ServeProcess, k: &'static str| gate.post(TARGET).key(k).body("{}").send();

    let gate = serve_with_keys(&config, listen, admin, key("old", OLD)).await;
    let mut first = Vec::new();
    for k in keys {
        let resp = send(&gate, k).await;
        assert_eq!(resp.status(), 201, "{}", resp.text());
        assert!(send(&gate, k).await.replayed());
        first.push(resp);
    }
    stop(gate).await;
    let mut values = redis_values(&redis, &schema).await;
    let mut under_old = Vec::new();
    for k in keys {
        under_old.push(values.get(k).await);
    }

    let both = format!("{},{}", key("new", NEW), key("old", OLD));
    let away_arg = away.display().to_string();
    let run = run_to_completion(
        &["keys", "--config", &away_arg, "reencrypt"],
        &[("IDEMGATE_STORE_ENCRYPTION_KEYS", both.as_str())],
    )
    .await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.contains("done: 2 rewritten,"), "{run:?}");
    assert!(
        run.stdout
            .contains("2 rewritten records kept their Redis copy under the old key"),
        "{run:?}"
    );
    for (k, old) in keys.into_iter().zip(&under_old) {
        assert_eq!(&values.get(k).await, old, "{k}: the copy is left as it was");
    }
    values.flip("k-tampered").await;

    let gate = serve_with_keys(&config, listen, admin, key("new", NEW)).await;
    for (k, first) in keys.into_iter().zip(&first) {
        for _ in 0..2 {
            let replay = send(&gate, k).await;
            assert!(
                replay.replayed(),
                "{k}: {} {}",
                replay.status(),
                replay.text()
            );
            assert_eq!(replay.body, first.body, "{k}: byte for byte");
            assert_eq!(replay.header("location"), first.header("location"));
        }
    }
    for (k, old) in keys.into_iter().zip(&under_old) {
        assert_ne!(&values.get(k).await, old, "{k}: the copy is replaced");
    }
    assert_eq!(up.hits(ORDERS), keys.len(), "each ran once");
    let metrics = gate.admin_get("/metrics").send().await.text();
    assert!(
        !metrics.contains("idemgate_sealed_unreadable_total{"),
        "{metrics}"
    );
    stop(gate).await;
    drop_schema(&url, &schema).await;
    drop_redis_keys(&redis, &schema).await;
}

/// A response stored before keys were set: it still replays once they
/// are (in plaintext, as stored); `keys reencrypt` seals it (the census
/// before and after says so), and it replays byte for byte under the key
/// alone, never run again. With `store.plaintext_responses = "refuse"` it
/// is a 410 until sealed, and replays once it is.
async fn sealed_after_the_fact(store: impl Fn(TestConfig) -> TestConfig) {
    let up = Upstream::start().await;
    let dir = tempfile::TempDir::new().expect("tempdir");
    let config = dir.path().join("idemgate.toml");
    let (listen, admin) = (free_port(), free_port());
    let base = store(
        TestConfig::new(up.addr)
            .listen(listen, admin)
            .route(Route::post(ORDERS)),
    );
    base.write(&config);
    let strict = dir.path().join("strict.toml");
    base.set("store.plaintext_responses", "refuse")
        .write(&strict);
    let send = |gate: &ServeProcess| gate.post(TARGET).key("k-before").body("{}").send();
    async fn replays(gate: &ServeProcess, first: &Resp) {
        let replay = gate.post(TARGET).key("k-before").body("{}").send().await;
        assert!(replay.replayed(), "{} {}", replay.status(), replay.text());
        assert_eq!(replay.body, first.body, "byte for byte");
        assert_eq!(replay.header("location"), first.header("location"));
    }

    let gate = ServeProcess::start(&config, listen, admin, &[]).await;
    let first = send(&gate).await;
    assert_eq!(first.status(), 201, "{}", first.text());
    replays(&gate, &first).await;
    stop(gate).await;

    let gate = serve_with_keys(&config, listen, admin, key("new", NEW)).await;
    replays(&gate, &first).await;
    stop(gate).await;

    // With plaintext refused, the record not sealed yet is a 410, counted,
    // and not run again (review F1: a plaintext response planted in the
    // store would be served otherwise).
    let gate = serve_with_keys(&strict, listen, admin, key("new", NEW)).await;
    let refused = send(&gate).await;
    assert_eq!(refused.status(), 410, "{}", refused.text());
    let metrics = gate.admin_get("/metrics").send().await.text();
    assert!(
        metrics.contains("idemgate_sealed_unreadable_total{reason=\"plaintext\"} 1"),
        "{metrics}"
    );
    stop(gate).await;

    let keys = key("new", NEW);
    let env = [("IDEMGATE_STORE_ENCRYPTION_KEYS", keys.as_str())];
    let config_arg = config.display().to_string();
    let check = ["check-config", "--connect", "-c", &config_arg];
    let census = run_to_completion(&check, &env).await;
    assert!(
        census.stdout.contains("by configured key id: none;")
            && census.stdout.contains("not sealed: 1"),
        "{census:?}"
    );
    let run = run_to_completion(&["keys", "--config", &config_arg, "reencrypt"], &env).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.contains("done: 1 rewritten,"), "{run:?}");
    let census = run_to_completion(&check, &env).await;
    assert!(
        census
            .stdout
            .contains("by configured key id: new (current) 1;")
            && census.stdout.contains("not sealed: 0"),
        "{census:?}"
    );

    // Sealed now: replayed with plaintext refused too.
    let gate = serve_with_keys(&strict, listen, admin, key("new", NEW)).await;
    replays(&gate, &first).await;
    stop(gate).await;
    assert_eq!(up.hits(ORDERS), 1, "run once in all");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_stored_before_keys_replays_and_reencrypt_seals_it_on_sqlite() {
    let dir = tempfile::TempDir::new().expect("tempdir");
    let db = dir.path().join("before.db").display().to_string();
    sealed_after_the_fact(|c| {
        c.set("store.backend", "sqlite")
            .set("store.path", db.as_str())
    })
    .await;
}

/// On PostgreSQL, where the live rows can be read: plaintext before the
/// rewrite, no byte run of the response after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_stored_before_keys_replays_and_reencrypt_seals_it_on_postgres() {
    let url = database_url();
    require_postgres(&url).await;
    let schema = unique_schema("vault_before");
    sealed_after_the_fact(|c| on_postgres(c, &url, &schema)).await;
    let kept = rows(&url, &schema).await;
    assert_eq!(kept.len(), 1, "one record");
    assert!(!kept.iter().any(|b| holds_run(b)), "sealed at rest");
    drop_schema(&url, &schema).await;
}

/// The stored digest of an idempotency key, as hex.
fn hex_key(k: &str) -> String {
    hex::encode(idemgate::idempotency::key::hash_key(k))
}
