//! What the Redis fast-path failover tests share: how often the upstream
//! ran a key, the fast path's hit count, the epoch in a key name, and an
//! operator's `keys delete` through the real binary, and their config.

use super::process::run_to_completion;
use super::services::{database_url, TestSchema};
use super::{metric_value, Route, ServeProcess, TestConfig, Upstream, ORDERS};
use std::net::SocketAddr;
use std::path::Path;

/// How many times the upstream ran `key`.
pub fn executions(up: &Upstream, key: &str) -> usize {
    up.seen()
        .iter()
        .filter(|s| s.headers.get("idempotency-key").is_some_and(|v| v == key))
        .count()
}

/// Claims the fast path answered from Redis alone, from `/metrics`.
pub async fn fast_path_hits(serve: &ServeProcess) -> u64 {
    metric_value(
        &serve.admin_get("/metrics").send().await.text(),
        "idemgate_redis_fast_path_hits_total",
    )
}

/// The epoch in `{prefix}:{epoch}:{scope}:{key}`.
pub fn epoch_of<'n>(name: &'n str, prefix: &str) -> &'n str {
    name[prefix.len() + 1..]
        .split(':')
        .next()
        .expect("an epoch")
}

/// `idemgate keys -c <config> delete --anonymous <key>`, which must succeed.
pub async fn delete_key(config: &Path, key: &str) {
    let config = config.to_str().expect("a UTF-8 path");
    let args = ["keys", "-c", config, "delete", "--anonymous", key];
    let out = run_to_completion(&args, &[]).await;
    assert_eq!(out.code, 0, "{}{}", out.stdout, out.stderr);
}

/// The config of a fast-path test: one `POST` route to `up` on `listen`
/// and `admin`, the shared PostgreSQL in `schema`, Redis keys under
/// `schema`'s prefix; the caller says where Redis is.
pub fn config_on_postgres(
    up: SocketAddr,
    listen: SocketAddr,
    admin: SocketAddr,
    schema: &TestSchema,
) -> TestConfig {
    TestConfig::new(up)
        .listen(listen, admin)
        .route(Route::post(ORDERS))
        .set("store.backend", "postgres")
        .set("store.url", database_url())
        .set("store.schema", schema.schema.as_str())
        .set("store.pool_size", 4)
        .set("redis.prefix", schema.prefix.as_str())
}
