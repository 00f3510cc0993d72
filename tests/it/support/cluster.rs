//! Replicas sharing one PostgreSQL schema and, with `redis`, one Redis
//! prefix: real `idemgate serve` processes in front of one upstream.

use super::services::{database_url, redis_url, require_postgres, require_redis};
use super::{free_port, Req, Route, ServeProcess, TestConfig, TestSchema, Upstream, ORDERS};
use std::sync::Arc;

/// Field order matters: the processes are killed before the schema is
/// dropped.
pub struct Cluster {
    pub replicas: Vec<ServeProcess>,
    _dir: tempfile::TempDir,
    _schema: Arc<TestSchema>,
}

impl Cluster {
    /// `n` replicas, started together (migrations race under the advisory
    /// lock, as in a real rollout), each with a store pool of `pool_size`,
    /// serving `route`, with the fast path when `redis`, and each replica's
    /// extra environment (`env_of(i)`).
    pub async fn start(
        n: usize,
        up: &Upstream,
        redis: bool,
        route: Route,
        pool_size: i64,
        env_of: impl Fn(usize) -> Vec<(&'static str, String)>,
    ) -> Self {
        let db = database_url();
        require_postgres(&db).await;
        if redis {
            require_redis(&redis_url());
        }
        let schema = Arc::new(TestSchema::new());
        let dir = tempfile::TempDir::new().expect("tempdir");
        let starts = (0..n).map(|i| {
            let (listen, admin) = (free_port(), free_port());
            let mut config = TestConfig::new(up.addr)
                .listen(listen, admin)
                .set("server.shutdown_grace", "5s")
                .set("store.backend", "postgres")
                .set("store.url", db.as_str())
                .set("store.schema", schema.schema.as_str())
                .set("store.pool_size", pool_size)
                .set("store.connect_timeout", "1s")
                .route(route.clone());
            if redis {
                config = config
                    .set("redis.url", redis_url())
                    .set("redis.prefix", schema.prefix.as_str())
                    .set("redis.timeout", "250ms");
            }
            let path = dir.path().join(format!("replica-{i}.toml"));
            config.write(&path);
            let env = env_of(i);
            async move {
                let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
                ServeProcess::start(&path, listen, admin, &env).await
            }
        });
        let replicas = futures_util::future::join_all(starts).await;
        Self {
            replicas,
            _dir: dir,
            _schema: schema,
        }
    }

    /// `POST /orders` with `key` and `body` to replica `replica` (modulo
    /// their number).
    pub fn order(&self, replica: usize, key: &str, body: &str) -> Req {
        self.replicas[replica % self.replicas.len()]
            .post(ORDERS)
            .key(key)
            .body(body.to_string())
    }
}
