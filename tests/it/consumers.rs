//! Message consumers (`[[consumer]]`, issue 24) through the real binary
//! against the real brokers: RabbitMQ and NATS JetStream on this machine
//! (a private `nats-server` where a test restarts the broker), on SQLite
//! and on PostgreSQL with two replicas consuming one queue. Each message
//! key must execute once; the queue must end empty; each fate lands where
//! the README's fate table says.

use crate::support::brokers::{
    close_idemgate_connection, rabbitmq_counts, rabbitmq_counts_on, Handler, PrivateNats,
    PrivateRabbit, TestQueue, TestStream, AMQP_URL, NATS_URL,
};
use crate::support::redis_tls::TestPki;
use crate::support::services::{database_url, redis_url, require_postgres, require_redis};
use crate::support::{
    free_port, run_to_completion, wait_for, ServeProcess, TestConfig, TestSchema,
};
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;
use toml::{Table, Value};

pub(crate) const CONSUMER: &str = "reserve";

pub(crate) fn table(pairs: &[(&str, Value)]) -> Value {
    Value::Table(
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
    )
}

pub(crate) fn s(v: &str) -> Value {
    Value::String(v.to_string())
}

/// A `[[consumer]]` reading `source`, delivering to `POST /reserve`.
pub(crate) fn consumer(source: Value, extra: &[(&str, Value)]) -> Value {
    let mut t = Table::new();
    t.insert("name".into(), s(CONSUMER));
    t.insert("source".into(), source);
    t.insert(
        "deliver".into(),
        table(&[("method", s("POST")), ("path", s("/reserve"))]),
    );
    t.insert("lease".into(), s("1s"));
    t.insert("retry_initial".into(), s("100ms"));
    t.insert("retry_max".into(), s("400ms"));
    for (k, v) in extra {
        t.insert(k.to_string(), v.clone());
    }
    Value::Table(t)
}

fn amqp(queue: &str, prefetch: i64) -> Value {
    amqp_at(AMQP_URL, queue, prefetch)
}

fn amqp_at(url: &str, queue: &str, prefetch: i64) -> Value {
    table(&[(
        "amqp",
        table(&[
            ("url", s(url)),
            ("queue", s(queue)),
            ("prefetch", Value::Integer(prefetch)),
        ]),
    )])
}

pub(crate) fn jetstream(url: &str, stream: &TestStream, ack_wait: &str) -> Value {
    table(&[(
        "jetstream",
        table(&[
            ("url", s(url)),
            ("stream", s(&stream.name)),
            ("durable", s(CONSUMER)),
            ("ack_wait", s(ack_wait)),
            ("max_ack_pending", Value::Integer(16)),
            ("dead_letter_subject", s(&stream.dead_subject)),
        ]),
    )])
}

/// The store a replica runs on.
#[derive(Clone, Copy)]
pub(crate) enum Store<'a> {
    /// In `dir`.
    Sqlite,
    Memory,
    Postgres(&'a TestSchema),
    /// PostgreSQL with the Redis fast path (the schema's prefix).
    PostgresRedis(&'a TestSchema),
}

/// One `idemgate serve` with `consumer`, on `store`.
pub(crate) struct Replica {
    pub(crate) config: std::path::PathBuf,
    listen: std::net::SocketAddr,
    admin: std::net::SocketAddr,
    process: Option<ServeProcess>,
}

impl Replica {
    pub(crate) async fn start(
        dir: &Path,
        i: usize,
        handler: &Handler,
        consumer: Value,
        store: Store<'_>,
    ) -> Self {
        let (listen, admin) = (free_port(), free_port());
        let mut config = TestConfig::new(handler.addr)
            .listen(listen, admin)
            .set("server.shutdown_grace", "3s")
            .set("consumer", Value::Array(vec![consumer]));
        config = match store {
            Store::Sqlite => config
                .set("store.backend", "sqlite")
                .set("store.path", dir.join("store.db").display().to_string()),
            Store::Memory => config.set("store.backend", "memory"),
            Store::Postgres(schema) | Store::PostgresRedis(schema) => config
                .set("store.backend", "postgres")
                .set("store.url", database_url())
                .set("store.schema", schema.schema.as_str())
                .set("store.pool_size", 4),
        };
        if let Store::PostgresRedis(schema) = store {
            require_redis(&redis_url());
            config = config
                .set("redis.url", redis_url())
                .set("redis.prefix", schema.prefix.as_str());
        }
        let path = dir.join(format!("replica-{i}.toml"));
        config.write(&path);
        let process = ServeProcess::start(&path, listen, admin, &[]).await;
        Self {
            config: path,
            listen,
            admin,
            process: Some(process),
        }
    }

    pub(crate) fn p(&self) -> &ServeProcess {
        self.process.as_ref().expect("running")
    }

    pub(crate) fn kill(&mut self) {
        if let Some(mut p) = self.process.take() {
            p.kill();
        }
    }

    async fn restart(&mut self) {
        self.kill();
        self.process = Some(ServeProcess::start(&self.config, self.listen, self.admin, &[]).await);
    }

    async fn metrics(&self) -> String {
        self.p().admin_get("/metrics").send().await.text()
    }

    /// `idemgate_consumer_<name>_total{consumer="reserve"[,reason]}`.
    pub(crate) async fn counter(&self, name: &str, reason: Option<&str>) -> u64 {
        let labels = match reason {
            None => format!("{{consumer=\"{CONSUMER}\"}}"),
            Some(r) => format!("{{consumer=\"{CONSUMER}\",reason=\"{r}\"}}"),
        };
        let want = format!("idemgate_consumer_{name}{labels} ");
        let text = self.metrics().await;
        text.lines()
            .find_map(|l| l.strip_prefix(&want))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .map_or(0, |v| v as u64)
    }
}

fn order(i: usize, extra: &str) -> String {
    format!("{{\"order\":{i}{extra}}}")
}

/// Waits until every key in `keys` executed, then for `settled` (the
/// broker holds nothing more).
/// Waits until a broker outage can come mid-run: some messages executed.
async fn some_executed(handler: &Handler) {
    wait_for("some messages to execute", || async {
        (handler.counts().len() >= 40).then_some(())
    })
    .await;
}

/// With the broker just taken down: not every message ran yet, and the
/// replica's `/healthz` and `broker_up` say the broker is down.
async fn outage_shown(replica: &Replica, handler: &Handler, keys: &[String]) {
    let before = handler.counts().len();
    assert!(
        before < keys.len(),
        "the outage came after every message ran"
    );
    wait_for("the outage to show on /healthz", || async {
        let h = replica.p().admin_get("/healthz").send().await.text();
        h.contains("broker down").then_some(())
    })
    .await;
    assert_eq!(replica.counter("broker_up", None).await, 0);
}

async fn wait_executed(handler: &Handler, keys: &[String]) {
    wait_for("every message to execute", || async {
        let counts = handler.counts();
        keys.iter().all(|k| counts.contains_key(k)).then_some(())
    })
    .await;
}

fn assert_once(handler: &Handler, keys: &[String]) {
    let counts = handler.counts();
    let twice: Vec<(&String, &usize)> = counts.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "executed other than once: {twice:?}");
    for k in keys {
        assert_eq!(counts.get(k), Some(&1), "{k}");
    }
}

// ===== RabbitMQ =====

/// 200 messages with forced redeliveries: the broker closes the
/// consumer's connection while deliveries are in flight (they finish and
/// are recorded, their acks are lost, the redeliveries replay), and the
/// consumer is SIGKILLed holding deliveries unacked (while the upstream
/// refuses, so nothing is in doubt) and started again; then 50
/// duplicates of messages already done. Each message id executes once,
/// the duplicates are answered from the record, and the queue ends empty
/// with nothing unacked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_messages_execute_once_across_redeliveries_and_duplicates() {
    let handler = Handler::start().await;
    let queue = TestQueue::new("idemgate_once").await;
    let dir = tempfile::TempDir::new().unwrap();
    let keys: Vec<String> = (0..200).map(|i| format!("m{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        queue.publish(Some(k), &order(i, ",\"delay_ms\":5")).await;
    }
    let c = consumer(amqp(&queue.name, 16), &[]);
    let mut replica = Replica::start(dir.path(), 0, &handler, c, Store::Sqlite).await;
    wait_for("a third of the messages to execute", || async {
        (handler.counts().len() >= 60).then_some(())
    })
    .await;
    close_idemgate_connection(&queue.name);
    wait_for("two thirds of the messages to execute", || async {
        (handler.counts().len() >= 130).then_some(())
    })
    .await;
    handler.set_unavailable(true);
    tokio::time::sleep(Duration::from_millis(600)).await;
    replica.restart().await;
    handler.set_unavailable(false);
    wait_executed(&handler, &keys).await;
    for (i, k) in keys.iter().take(50).enumerate() {
        queue.publish(Some(k), &order(i, ",\"delay_ms\":5")).await;
    }
    wait_for("the 50 duplicates to be suppressed", || async {
        (replica.counter("duplicates_suppressed_total", None).await >= 50).then_some(())
    })
    .await;
    wait_for("the queue to end empty, nothing unacked", || async {
        (rabbitmq_counts(&queue.name) == (0, 0)).then_some(())
    })
    .await;
    assert_once(&handler, &keys);
    assert!(queue.drain_dead_letters().await.is_empty());
    replica.kill();
    queue.delete().await;
}

/// The fate table on RabbitMQ: 422 dead-letters once (and its duplicate
/// too, without a second execution); 503 then 201 is one success, acked;
/// a message without a key is dead-lettered; a key whose every attempt
/// answers 503 is dead-lettered after `max_attempts`; one whose upstream
/// executed and never answered is parked (`on_ambiguous = "keep"`) and
/// dead-lettered for an operator, not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_fates_follow_the_table() {
    let handler = Handler::start().await;
    let queue = TestQueue::new("idemgate_fates").await;
    let dir = tempfile::TempDir::new().unwrap();
    let c = consumer(
        amqp(&queue.name, 8),
        &[
            ("max_attempts", Value::Integer(3)),
            ("on_ambiguous", s("keep")),
        ],
    );
    let replica = Replica::start(dir.path(), 0, &handler, c, Store::Sqlite).await;
    queue.publish(Some("k422"), r#"{"plan":[422]}"#).await;
    queue.publish(Some("k503"), r#"{"plan":[503,201]}"#).await;
    queue.publish(None, r#"{"no":"key"}"#).await;
    queue.publish(Some("kdown"), r#"{"plan":[503]}"#).await;
    queue.publish(Some("kreset"), r#"{"reset":true}"#).await;
    wait_for("the 422 to be dead-lettered", || async {
        (replica
            .counter("messages_dead_lettered_total", Some("rejected"))
            .await
            == 1)
            .then_some(())
    })
    .await;
    queue.publish(Some("k422"), r#"{"plan":[422]}"#).await;
    wait_for("every fate", || async {
        let dl = |r| replica.counter("messages_dead_lettered_total", Some(r));
        let done = dl("rejected").await == 2
            && dl("no_key").await == 1
            && dl("exhausted").await == 1
            && dl("outcome_unknown").await == 1
            && handler.runs("k503") == [503, 201];
        done.then_some(())
    })
    .await;
    wait_for("the queue to end empty, nothing unacked", || async {
        (rabbitmq_counts(&queue.name) == (0, 0)).then_some(())
    })
    .await;
    assert_eq!(
        handler.runs("k422"),
        [422],
        "the duplicate did not run again"
    );
    assert_eq!(handler.runs("kdown"), [503, 503, 503], "max_attempts = 3");
    assert_eq!(handler.runs("kreset").len(), 1, "parked, not run again");
    let mut dead = queue.drain_dead_letters().await;
    dead.sort();
    assert_eq!(dead, ["k422", "k422", "kdown", "kreset", r#"{"no":"key"}"#]);
    assert_eq!(
        replica.counter("duplicates_suppressed_total", None).await,
        1
    );
    let health = replica.p().admin_get("/healthz").send().await.text();
    assert_eq!(health, format!("ok\nconsumer {CONSUMER}: broker up\n"));
    // The operator finds a message's record by its consumer and key.
    let config = replica.config.display().to_string();
    let shown = run_to_completion(
        &[
            "keys",
            "show",
            "--consumer",
            CONSUMER,
            "k422",
            "--config",
            &config,
        ],
        &[],
    )
    .await;
    assert_eq!(shown.code, 0, "{shown:?}");
    assert!(shown.stdout.contains("422"), "{}", shown.stdout);
    let deleted = run_to_completion(
        &[
            "keys",
            "delete",
            "--consumer",
            CONSUMER,
            "kdown",
            "--config",
            &config,
        ],
        &[],
    )
    .await;
    assert_eq!(deleted.code, 0, "{deleted:?}");
    drop(replica);
    queue.delete().await;
}

/// Two replicas on PostgreSQL consume one queue; one is SIGKILLed while
/// deliveries are in flight. Every message executes; only a message the
/// killed replica had sent upstream and not recorded may run again, after
/// its lease (the documented at-least-once release), and none more than
/// twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_two_postgres_replicas_share_a_queue_and_survive_a_kill() {
    require_postgres(&database_url()).await;
    let handler = Handler::start().await;
    let queue = TestQueue::new("idemgate_replicas").await;
    let schema = TestSchema::new();
    let dir = tempfile::TempDir::new().unwrap();
    let c = || consumer(amqp(&queue.name, 4), &[]);
    let mut a = Replica::start(dir.path(), 0, &handler, c(), Store::Postgres(&schema)).await;
    let b = Replica::start(dir.path(), 1, &handler, c(), Store::Postgres(&schema)).await;
    let keys: Vec<String> = (0..200).map(|i| format!("r{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        queue.publish(Some(k), &order(i, ",\"delay_ms\":10")).await;
    }
    for (i, k) in keys.iter().take(50).enumerate() {
        queue.publish(Some(k), &order(i, ",\"delay_ms\":10")).await;
    }
    wait_for("a third of the messages to execute", || async {
        (handler.counts().len() >= 70).then_some(())
    })
    .await;
    a.kill();
    wait_executed(&handler, &keys).await;
    wait_for("the queue to end empty, nothing unacked", || async {
        (rabbitmq_counts(&queue.name) == (0, 0)).then_some(())
    })
    .await;
    let counts: HashMap<String, usize> = handler.counts();
    let again: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(counts.values().all(|n| *n <= 2), "{again:?}");
    assert!(
        again.len() <= 4,
        "only the killed replica's in-flight deliveries (prefetch 4) may run again: {again:?}"
    );
    assert_eq!(counts.len(), 200);
    assert!(queue.drain_dead_letters().await.is_empty());
    drop(b);
    queue.delete().await;
}

/// A private RabbitMQ node stopped and started again mid-run: the
/// consumer shows the outage, reconnects, and every message executes once
/// (those whose acks were lost with the connection are answered from the
/// record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_broker_restart_loses_nothing_and_runs_nothing_twice() {
    let mut rabbit = PrivateRabbit::start().await;
    let url = rabbit.url();
    let handler = Handler::start().await;
    let queue = TestQueue::on(&url, "idemgate_restart").await;
    let dir = tempfile::TempDir::new().unwrap();
    let keys: Vec<String> = (0..150).map(|i| format!("q{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        queue.publish(Some(k), &order(i, ",\"delay_ms\":50")).await;
    }
    let c = consumer(amqp_at(&url, &queue.name, 2), &[]);
    let replica = Replica::start(dir.path(), 0, &handler, c, Store::Sqlite).await;
    some_executed(&handler).await;
    rabbit.down();
    outage_shown(&replica, &handler, &keys).await;
    rabbit.up().await;
    wait_executed(&handler, &keys).await;
    wait_for("the queue to end empty, nothing unacked", || async {
        (rabbitmq_counts_on(&rabbit.node, &queue.name) == (0, 0)).then_some(())
    })
    .await;
    assert_once(&handler, &keys);
    let log = replica.p().log();
    wait_for("broker_up to be 1 again", || async {
        (replica.counter("broker_up", None).await == 1).then_some(())
    })
    .await;
    assert_eq!(
        log.matches("broker connection lost or refused").count(),
        1,
        "{log}"
    );
    drop(replica);
}

/// The retry copy does not keep the original's `x-delivery-count` (review
/// M2): a message carrying one (as a quorum queue's redelivery does) had it
/// added to the copy's attempt number again, so it was dead-lettered as
/// `exhausted` attempts early. Its `user_id` is dropped too (checked in the
/// unit test: here idemgate and the producer are the same user).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_retry_copy_drops_the_stale_delivery_count() {
    use lapin::types::{AMQPValue, FieldTable, ShortString};
    let handler = Handler::start().await;
    let queue = TestQueue::new("idemgate_copy").await;
    let dir = tempfile::TempDir::new().unwrap();
    let c = consumer(amqp(&queue.name, 4), &[("max_attempts", Value::Integer(4))]);
    let replica = Replica::start(dir.path(), 0, &handler, c, Store::Memory).await;
    let mut headers = FieldTable::default();
    headers.insert(ShortString::from("x-delivery-count"), AMQPValue::LongInt(1));
    let props = lapin::BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type(ShortString::from("application/json"))
        .with_message_id(ShortString::from("m1"))
        .with_user_id(ShortString::from("guest"))
        .with_headers(headers);
    queue
        .channel
        .basic_publish(
            ShortString::from(""),
            ShortString::from(queue.name.clone()),
            lapin::options::BasicPublishOptions::default(),
            br#"{"plan":[503,503,201]}"#,
            props,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    wait_for("m1 to settle", || async {
        let runs = handler.runs("m1");
        let dead = replica
            .counter("messages_dead_lettered_total", Some("exhausted"))
            .await;
        (runs.last() == Some(&201) || dead > 0).then_some(())
    })
    .await;
    assert_eq!(handler.runs("m1"), [503, 503, 201]);
    wait_for("the queue to be empty", || async {
        (rabbitmq_counts(&queue.name) == (0, 0)).then_some(())
    })
    .await;
    assert!(queue.drain_dead_letters().await.is_empty());
    drop(replica);
    queue.delete().await;
}

// ===== NATS JetStream =====

/// 200 messages and 50 duplicates (the same `x-order-id`, another
/// publish), a handler slower than `ack_wait` (kept by `+WPI`), and a
/// consumer SIGKILLed and started again (while the upstream refuses): each key executes once and
/// nothing stays pending or unacked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_messages_execute_once_with_progress_duplicates_and_a_kill() {
    let handler = Handler::start().await;
    let stream = TestStream::new(NATS_URL, "idemgate_once").await;
    let dir = tempfile::TempDir::new().unwrap();
    let c = consumer(
        jetstream(NATS_URL, &stream, "1s"),
        &[("key", table(&[("header", s("x-order-id"))]))],
    );
    let keys: Vec<String> = (0..200).map(|i| format!("j{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        // Two handlers outlast ack_wait: progress keeps them.
        let delay = if i < 2 { 1600 } else { 5 };
        let body = order(i, &format!(",\"delay_ms\":{delay}"));
        stream.publish(None, &[("x-order-id", k)], &body).await;
    }
    let mut replica = Replica::start(dir.path(), 0, &handler, c, Store::Sqlite).await;
    wait_for("half the messages to execute", || async {
        (handler.counts().len() >= 100).then_some(())
    })
    .await;
    // SIGKILLed holding deliveries (nak'd or in flight) while the
    // upstream refuses, so nothing is in doubt; they come back.
    handler.set_unavailable(true);
    tokio::time::sleep(Duration::from_millis(600)).await;
    replica.restart().await;
    handler.set_unavailable(false);
    wait_executed(&handler, &keys).await;
    for (i, k) in keys.iter().take(50).enumerate() {
        let body = order(
            i,
            if i < 2 {
                ",\"delay_ms\":1600"
            } else {
                ",\"delay_ms\":5"
            },
        );
        stream.publish(None, &[("x-order-id", k)], &body).await;
    }
    wait_for("the 50 duplicates to be suppressed", || async {
        (replica.counter("duplicates_suppressed_total", None).await >= 50).then_some(())
    })
    .await;
    wait_for("nothing pending or unacked", || async {
        (stream.consumer_counts(CONSUMER).await == Some((0, 0))).then_some(())
    })
    .await;
    assert_once(&handler, &keys);
    assert!(stream.dead_letters().await.is_empty());
    replica.kill();
    stream.delete().await;
}

/// The fate table on JetStream (on the memory store), dead letters
/// published to the `dead_letter_subject` with their reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_fates_follow_the_table() {
    let handler = Handler::start().await;
    let stream = TestStream::new(NATS_URL, "idemgate_fates").await;
    let dir = tempfile::TempDir::new().unwrap();
    let c = consumer(
        jetstream(NATS_URL, &stream, "5s"),
        &[
            ("key", table(&[("header", s("x-order-id"))])),
            ("max_attempts", Value::Integer(3)),
        ],
    );
    let replica = Replica::start(dir.path(), 0, &handler, c, Store::Memory).await;
    stream
        .publish(None, &[("x-order-id", "k422")], r#"{"plan":[422]}"#)
        .await;
    stream
        .publish(None, &[("x-order-id", "k503")], r#"{"plan":[503,201]}"#)
        .await;
    stream.publish(None, &[], r#"{"no":"key"}"#).await;
    stream
        .publish(None, &[("x-order-id", "kdown")], r#"{"plan":[503]}"#)
        .await;
    wait_for("the 422 to be dead-lettered", || async {
        (replica
            .counter("messages_dead_lettered_total", Some("rejected"))
            .await
            == 1)
            .then_some(())
    })
    .await;
    stream
        .publish(None, &[("x-order-id", "k422")], r#"{"plan":[422]}"#)
        .await;
    // A different payload under a used key: the 422 case of HTTP.
    stream
        .publish(None, &[("x-order-id", "k503")], r#"{"other":1}"#)
        .await;
    wait_for("every fate", || async {
        let dl = |r| replica.counter("messages_dead_lettered_total", Some(r));
        let done = dl("rejected").await == 2
            && dl("no_key").await == 1
            && dl("exhausted").await == 1
            && dl("mismatch").await == 1
            && handler.runs("k503") == [503, 201];
        done.then_some(())
    })
    .await;
    wait_for("nothing pending or unacked", || async {
        (stream.consumer_counts(CONSUMER).await == Some((0, 0))).then_some(())
    })
    .await;
    assert_eq!(handler.runs("k422"), [422]);
    assert_eq!(handler.runs("kdown"), [503, 503, 503]);
    let mut dead = stream.dead_letters().await;
    dead.sort();
    let want = [
        ("k422", "rejected"),
        ("k422", "rejected"),
        ("k503", "mismatch"),
        ("kdown", "exhausted"),
        (r#"{"no":"key"}"#, "no_key"),
    ];
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    assert_eq!(dead, want);
    drop(replica);
    stream.delete().await;
}

/// A dead letter is a copy of its own (review H1): the original's
/// `Nats-*` headers are not copied (its `Nats-Expected-Stream` made every
/// dead-letter publish fail, so the message was never termed; its
/// `Nats-Msg-Id` made the dead-letter stream drop a second dead letter of
/// the same id within its duplicate window), the original id is carried
/// as `Idemgate-Original-Msg-Id`, and the copy's id is the delivery's
/// stream and sequence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_dead_letters_drop_the_originals_nats_headers() {
    let handler = Handler::start().await;
    // The consumed stream forgets ids after 1 s, so the same id can be
    // published again; the dead-letter stream keeps the default 2 min.
    let stream = TestStream::with_window(NATS_URL, "idemgate_dlh", Duration::from_secs(1)).await;
    let dir = tempfile::TempDir::new().unwrap();
    let c = consumer(
        jetstream(NATS_URL, &stream, "5s"),
        &[("key", table(&[("header", s("x-order-id"))]))],
    );
    let replica = Replica::start(dir.path(), 0, &handler, c, Store::Memory).await;
    let expected = stream.name.clone();
    let first = [
        ("x-order-id", "k422"),
        ("Nats-Expected-Stream", expected.as_str()),
    ];
    stream
        .publish(Some("order-1"), &first, r#"{"plan":[422]}"#)
        .await;
    wait_for("the 422 to be dead-lettered", || async {
        (replica
            .counter("messages_dead_lettered_total", Some("rejected"))
            .await
            == 1)
            .then_some(())
    })
    .await;
    // Past the consumed stream's window: the same id is stored again and
    // is dead-lettered from the record (inside the dead-letter stream's
    // window).
    wait_for("the consumed stream to store order-1 again", || async {
        let mut h = async_nats::HeaderMap::new();
        h.insert("Nats-Msg-Id", "order-1");
        h.insert("x-order-id", "k422");
        let subject = format!("{}.in", stream.name);
        let body = bytes::Bytes::from_static(br#"{"plan":[422]}"#);
        let ack = stream.js.publish_with_headers(subject, h, body).await;
        let ack = ack.unwrap().await.unwrap();
        if ack.duplicate {
            tokio::time::sleep(Duration::from_millis(200)).await;
            return None;
        }
        Some(())
    })
    .await;
    wait_for("both dead-lettered and nothing unacked", || async {
        let n = replica
            .counter("messages_dead_lettered_total", Some("rejected"))
            .await;
        (n == 2 && stream.consumer_counts(CONSUMER).await == Some((0, 0))).then_some(())
    })
    .await;
    assert_eq!(handler.runs("k422"), [422]);
    let dead = stream.dead_letter_headers().await;
    let h = |pairs: &[(&str, String)]| -> Vec<(String, String)> {
        let mut v: Vec<(String, String)> = pairs
            .iter()
            .map(|(n, v)| (n.to_string(), v.clone()))
            .collect();
        v.sort();
        v
    };
    let copy = |seq: u64| {
        h(&[
            ("Idemgate-Dead-Letter-Reason", "rejected".into()),
            ("Idemgate-Original-Msg-Id", "order-1".into()),
            ("Nats-Msg-Id", format!("idemgate-dl-{}-{seq}", stream.name)),
            ("x-order-id", "k422".into()),
        ])
    };
    assert_eq!(dead, [copy(1), copy(2)]);
    drop(replica);
    stream.delete().await;
}

/// A `dead_letter_subject` the consumed stream captures would bring each
/// dead letter back as a new message (a loop): the consumer refuses to
/// consume, names itself and the setting, and creates no durable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_dead_letter_subject_inside_the_consumed_stream_is_refused() {
    let handler = Handler::start().await;
    let stream = TestStream::new(NATS_URL, "idemgate_dlloop").await;
    let dir = tempfile::TempDir::new().unwrap();
    let mut source = jetstream(NATS_URL, &stream, "5s");
    source["jetstream"]["dead_letter_subject"] = s(&format!("{}.in", stream.name));
    let c = consumer(source, &[("key", table(&[("header", s("x-order-id"))]))]);
    let replica = Replica::start(dir.path(), 0, &handler, c, Store::Memory).await;
    stream
        .publish(None, &[("x-order-id", "k1")], r#"{"plan":[201]}"#)
        .await;
    wait_for("the refusal in the log", || async {
        let log = replica.p().log();
        log.lines()
            .find(|l| {
                l.contains("refusing to consume")
                    && l.contains("dead_letter_subject")
                    && l.contains(CONSUMER)
            })
            .map(drop)
    })
    .await;
    assert!(handler.counts().is_empty());
    assert_eq!(stream.consumer_counts(CONSUMER).await, None);
    drop(replica);
    stream.delete().await;
}

/// An existing durable is bound as it is (review M3), so one idemgate
/// cannot keep its promises with is refused, naming the setting: acks
/// other than explicit, a `max_deliver` limit (the server drops a message
/// silently after it), an `ack_wait` under 1 s (it made `+WPI`'s interval
/// zero, which panics). Nothing is consumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_an_existing_durable_with_wrong_settings_is_refused() {
    use async_nats::jetstream::consumer::{pull, AckPolicy};
    let handler = Handler::start().await;
    let ok = pull::Config {
        durable_name: Some(CONSUMER.to_string()),
        ack_policy: AckPolicy::Explicit,
        ack_wait: Duration::from_secs(5),
        ..Default::default()
    };
    let cases = [
        (
            pull::Config {
                ack_policy: AckPolicy::All,
                ..ok.clone()
            },
            "ack_policy All",
        ),
        (
            pull::Config {
                max_deliver: 5,
                ..ok.clone()
            },
            "max_deliver 5",
        ),
        (
            pull::Config {
                ack_wait: Duration::from_nanos(1),
                ..ok.clone()
            },
            "ack_wait 1ns",
        ),
    ];
    for (durable, want) in cases {
        let stream = TestStream::new(NATS_URL, "idemgate_durable").await;
        stream
            .js
            .get_stream(&stream.name)
            .await
            .unwrap()
            .create_consumer(durable)
            .await
            .unwrap();
        let dir = tempfile::TempDir::new().unwrap();
        let c = consumer(
            jetstream(NATS_URL, &stream, "5s"),
            &[("key", table(&[("header", s("x-order-id"))]))],
        );
        let mut replica = Replica::start(dir.path(), 0, &handler, c, Store::Memory).await;
        stream
            .publish(None, &[("x-order-id", "k1")], r#"{"plan":[201]}"#)
            .await;
        wait_for("the refusal in the log", || async {
            let log = replica.p().log();
            log.lines()
                .find(|l| {
                    l.contains("refusing to consume") && l.contains(want) && l.contains(CONSUMER)
                })
                .map(drop)
        })
        .await;
        replica.kill();
        assert!(handler.counts().is_empty(), "{want}");
        assert_eq!(
            stream.consumer_counts(CONSUMER).await,
            Some((1, 0)),
            "{want}"
        );
        stream.delete().await;
    }
}

/// A private nats-server stopped and started again mid-run: the consumer
/// shows the outage (metric, `/healthz`), reconnects, and every message
/// executes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_broker_restart_loses_nothing_and_runs_nothing_twice() {
    let mut nats = PrivateNats::start().await;
    let url = nats.url();
    let handler = Handler::start().await;
    let stream = TestStream::new(&url, "idemgate_restart").await;
    let dir = tempfile::TempDir::new().unwrap();
    let c = consumer(
        jetstream(&url, &stream, "2s"),
        &[("key", table(&[("header", s("x-order-id"))]))],
    );
    let keys: Vec<String> = (0..150).map(|i| format!("b{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        stream
            .publish(None, &[("x-order-id", k)], &order(i, ",\"delay_ms\":10"))
            .await;
    }
    let replica = Replica::start(dir.path(), 0, &handler, c, Store::Sqlite).await;
    some_executed(&handler).await;
    nats.down();
    outage_shown(&replica, &handler, &keys).await;
    nats.up().await;
    wait_executed(&handler, &keys).await;
    let stream = TestStream::reconnected(stream).await;
    wait_for("nothing pending or unacked", || async {
        (stream.consumer_counts(CONSUMER).await == Some((0, 0))).then_some(())
    })
    .await;
    assert_once(&handler, &keys);
    let log = replica.p().log();
    wait_for("broker_up to be 1 again", || async {
        (replica.counter("broker_up", None).await == 1).then_some(())
    })
    .await;
    assert_eq!(
        log.matches("broker connection lost or refused").count(),
        1,
        "{log}"
    );
    drop(replica);
    stream.delete().await;
}

// ===== TLS =====

/// `jetstream(...)` with `ca_file`, and a client certificate when given.
fn jetstream_tls(url: &str, stream: &TestStream, ca: &str, client: Option<(&str, &str)>) -> Value {
    let mut source = jetstream(url, stream, "5s");
    let t = source["jetstream"].as_table_mut().unwrap();
    t.insert("ca_file".into(), s(ca));
    if let Some((cert, key)) = client {
        t.insert("cert_file".into(), s(cert));
        t.insert("key_file".into(), s(key));
    }
    source
}

/// `amqp_at(...)` with `ca_file`, and a client certificate when given.
fn amqp_tls(url: &str, queue: &str, ca: &str, client: Option<(&str, &str)>) -> Value {
    let mut source = amqp_at(url, queue, 4);
    let t = source["amqp"].as_table_mut().unwrap();
    t.insert("ca_file".into(), s(ca));
    if let Some((cert, key)) = client {
        t.insert("cert_file".into(), s(cert));
        t.insert("key_file".into(), s(key));
    }
    source
}

/// `amqps://` through idemgate's own TLS code, against a private RabbitMQ
/// node with a TLS listener requiring client certificates: a CA that did
/// not sign the node's certificate is refused with the broker and the
/// cause named, and nothing is consumed; with the right CA and client
/// certificate every message executes once and the queue ends empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_over_verified_tls_refuses_a_ca_that_did_not_sign_the_broker() {
    let pki = TestPki::generate_for(&["localhost", "127.0.0.1"]);
    let rabbit = PrivateRabbit::start_tls(&pki).await;
    let url = rabbit.tls_url();
    let handler = Handler::start().await;
    // Published over the node's plain port.
    let queue = TestQueue::on(&rabbit.url(), "idemgate_tls").await;
    let keys: Vec<String> = (0..20).map(|i| format!("r{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        queue.publish(Some(k), &order(i, "")).await;
    }
    let dir = tempfile::TempDir::new().unwrap();
    let (cert, key) = (pki.client_cert(), pki.client_key());
    let client = Some((cert.as_str(), key.as_str()));

    let wrong = consumer(amqp_tls(&url, &queue.name, &pki.other_ca(), client), &[]);
    let replica = Replica::start(dir.path(), 0, &handler, wrong, Store::Sqlite).await;
    let want = "connect: TLS handshake with RabbitMQ failed: the broker's certificate is not trusted (unknown issuer): it is not signed by the CA in source ca_file";
    wait_for("the refused handshake to be logged", || async {
        replica.p().log().contains(want).then_some(())
    })
    .await;
    let health = replica.p().admin_get("/healthz").send().await.text();
    assert!(health.contains("broker down"), "{health}");
    drop(replica);
    assert!(handler.counts().is_empty(), "{:?}", handler.counts());
    assert_eq!(rabbitmq_counts_on(&rabbit.node, &queue.name), (20, 0));

    let right = consumer(amqp_tls(&url, &queue.name, &pki.ca(), client), &[]);
    let replica = Replica::start(dir.path(), 1, &handler, right, Store::Sqlite).await;
    wait_executed(&handler, &keys).await;
    wait_for("the queue to end empty, nothing unacked", || async {
        (rabbitmq_counts_on(&rabbit.node, &queue.name) == (0, 0)).then_some(())
    })
    .await;
    assert_once(&handler, &keys);
    let log = replica.p().log();
    assert!(!log.contains("TLS handshake"), "{log}");
    drop(replica);
}

/// NATS over TLS through idemgate's own TLS code (`net::tls`), against a
/// private `nats-server --tlsverify`: a CA that did not sign the server's
/// certificate is refused with the broker and the cause named, and
/// nothing is consumed; without a client certificate the broker refuses
/// idemgate; with the right CA and client certificate every message
/// executes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_over_verified_tls_refuses_a_ca_that_did_not_sign_the_broker() {
    let pki = TestPki::generate_for(&["localhost", "127.0.0.1"]);
    let nats = PrivateNats::start_tls(&pki).await;
    let url = nats.tls_url();
    let handler = Handler::start().await;
    let stream = TestStream::on(nats.tls_client(&pki).await, &url, "idemgate_tls").await;
    let keys: Vec<String> = (0..20).map(|i| format!("t{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        stream
            .publish(None, &[("x-order-id", k)], &order(i, ""))
            .await;
    }
    let dir = tempfile::TempDir::new().unwrap();
    let by_header = [("key", table(&[("header", s("x-order-id"))]))];
    let (cert, key) = (pki.client_cert(), pki.client_key());
    let client = Some((cert.as_str(), key.as_str()));

    let wrong = consumer(
        jetstream_tls(&url, &stream, &pki.other_ca(), client),
        &by_header,
    );
    let replica = Replica::start(dir.path(), 0, &handler, wrong, Store::Sqlite).await;
    let want = "connect: TLS handshake with NATS failed: the broker's certificate is not trusted (unknown issuer): it is not signed by the CA in source ca_file";
    wait_for("the refused handshake to be logged", || async {
        replica.p().log().contains(want).then_some(())
    })
    .await;
    let health = replica.p().admin_get("/healthz").send().await.text();
    assert!(health.contains("broker down"), "{health}");
    drop(replica);

    let no_cert = consumer(jetstream_tls(&url, &stream, &pki.ca(), None), &by_header);
    let replica = Replica::start(dir.path(), 1, &handler, no_cert, Store::Sqlite).await;
    let log = wait_for("the broker's refusal to be logged", || async {
        let log = replica.p().log();
        log.contains("broker connection lost or refused")
            .then_some(log)
    })
    .await;
    let want = "TLS handshake with NATS failed: the broker refused the client certificate";
    assert!(log.contains(want), "{log}");
    drop(replica);
    assert!(handler.counts().is_empty(), "{:?}", handler.counts());
    assert_eq!(
        stream.consumer_counts(CONSUMER).await,
        None,
        "bound without TLS?"
    );

    let right = consumer(jetstream_tls(&url, &stream, &pki.ca(), client), &by_header);
    let replica = Replica::start(dir.path(), 2, &handler, right, Store::Sqlite).await;
    wait_executed(&handler, &keys).await;
    wait_for("nothing pending or unacked", || async {
        (stream.consumer_counts(CONSUMER).await == Some((0, 0))).then_some(())
    })
    .await;
    assert_once(&handler, &keys);
    let log = replica.p().log();
    assert!(!log.contains("TLS handshake"), "{log}");
    drop(replica);

    // A CA file that cannot be read fails the start, named.
    let missing = dir.path().join("missing-ca.pem").display().to_string();
    let bad = consumer(jetstream_tls(&url, &stream, &missing, None), &by_header);
    let (listen, admin) = (free_port(), free_port());
    let path = dir.path().join("bad.toml");
    TestConfig::new(handler.addr)
        .listen(listen, admin)
        .set("store.backend", "memory")
        .set("consumer", Value::Array(vec![bad]))
        .write(&path);
    let run = run_to_completion(&["serve", "--config", &path.display().to_string()], &[]).await;
    assert_ne!(run.code, 0, "{run:?}");
    let want = format!("consumer \"{CONSUMER}\": source ca_file {missing}: ");
    assert!(run.stderr.contains(&want), "{run:?}");
    stream.delete().await;
}

// ===== shutdown, reload =====

/// SIGTERM with deliveries in flight: the consumer stops taking messages,
/// those in flight finish and are acked within the grace period, the rest
/// stay in the queue; started again, it runs them, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_graceful_shutdown_finishes_what_it_holds_and_leaves_the_rest() {
    let handler = Handler::start().await;
    let queue = TestQueue::new("idemgate_drain").await;
    let dir = tempfile::TempDir::new().unwrap();
    let keys: Vec<String> = (0..12).map(|i| format!("g{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        queue.publish(Some(k), &order(i, ",\"delay_ms\":700")).await;
    }
    let mut replica = Replica::start(
        dir.path(),
        0,
        &handler,
        consumer(amqp(&queue.name, 3), &[]),
        Store::Sqlite,
    )
    .await;
    wait_for("the first deliveries to reach the handler", || async {
        (replica.counter("in_flight", None).await == 3).then_some(())
    })
    .await;
    let mut p = replica.process.take().unwrap();
    p.terminate();
    assert_eq!(p.exited().await, Some(0), "{}", p.log());
    let done = handler.counts().len();
    assert!((3..12).contains(&done), "{done} executed before the exit");
    assert_eq!(
        rabbitmq_counts(&queue.name),
        ((12 - done) as u64, 0),
        "the rest wait, none unacked"
    );
    assert!(!p.log().contains("ERROR"), "{}", p.log());
    replica.restart().await;
    wait_executed(&handler, &keys).await;
    wait_for("the queue to end empty", || async {
        (rabbitmq_counts(&queue.name) == (0, 0)).then_some(())
    })
    .await;
    assert_once(&handler, &keys);
    replica.kill();
    queue.delete().await;
}

/// A reload keeps the running consumers and names a changed one as
/// needing a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_the_running_consumer_and_names_the_change() {
    let handler = Handler::start().await;
    let queue = TestQueue::new("idemgate_reload").await;
    let dir = tempfile::TempDir::new().unwrap();
    let replica = Replica::start(
        dir.path(),
        0,
        &handler,
        consumer(amqp(&queue.name, 3), &[]),
        Store::Sqlite,
    )
    .await;
    let text = std::fs::read_to_string(&replica.config).unwrap();
    std::fs::write(
        &replica.config,
        text.replace("prefetch = 3", "prefetch = 5"),
    )
    .unwrap();
    replica.p().hangup();
    wait_for("the reload's warning", || async {
        let log = replica.p().log();
        (log.contains("only change on a restart") && log.contains("consumer.reserve")).then_some(())
    })
    .await;
    queue.publish(Some("after-reload"), "{}").await;
    wait_executed(&handler, &["after-reload".to_string()]).await;
    drop(replica);
    queue.delete().await;
}

/// JetStream, two replicas on one PostgreSQL schema with the Redis fast
/// path, sharing one durable consumer: each key runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_two_postgres_redis_replicas_share_a_durable_consumer() {
    require_postgres(&database_url()).await;
    let handler = Handler::start().await;
    let stream = TestStream::new(NATS_URL, "idemgate_replicas").await;
    let schema = TestSchema::new();
    let dir = tempfile::TempDir::new().unwrap();
    let c = || {
        consumer(
            jetstream(NATS_URL, &stream, "2s"),
            &[("key", table(&[("header", s("x-order-id"))]))],
        )
    };
    let a = Replica::start(dir.path(), 0, &handler, c(), Store::PostgresRedis(&schema)).await;
    let b = Replica::start(dir.path(), 1, &handler, c(), Store::PostgresRedis(&schema)).await;
    let keys: Vec<String> = (0..150).map(|i| format!("p{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        stream
            .publish(None, &[("x-order-id", k)], &order(i, ",\"delay_ms\":5"))
            .await;
    }
    for (i, k) in keys.iter().take(50).enumerate() {
        stream
            .publish(None, &[("x-order-id", k)], &order(i, ",\"delay_ms\":5"))
            .await;
    }
    wait_executed(&handler, &keys).await;
    wait_for("nothing pending or unacked", || async {
        (stream.consumer_counts(CONSUMER).await == Some((0, 0))).then_some(())
    })
    .await;
    assert_once(&handler, &keys);
    let suppressed = a.counter("duplicates_suppressed_total", None).await
        + b.counter("duplicates_suppressed_total", None).await;
    assert!(suppressed >= 50, "{suppressed}");
    drop((a, b));
    stream.delete().await;
}

// ===== throughput (bench/consumers.sh) =====

/// Messages per second through idemgate (SQLite, and PostgreSQL, fresh
/// keys) against the same consumer without dedup (an in-process client:
/// consume, POST, ack), on each broker; `IDEMGATE_BENCH_MESSAGES` messages
/// (default 2000), prefetch / max_ack_pending 32. Run by
/// `bench/consumers.sh` (release build); ignored in the suite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: bench/consumers.sh"]
async fn throughput() {
    let n: usize = std::env::var("IDEMGATE_BENCH_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let mut rows = Vec::new();
    for broker in ["amqp", "jetstream"] {
        // Its own schema per broker: the keys ("b0"...) repeat.
        let schema = TestSchema::new();
        for dedup in [None, Some(Store::Sqlite), Some(Store::Postgres(&schema))] {
            let handler = Handler::start().await;
            let dir = tempfile::TempDir::new().unwrap();
            let (rate, keys) = match broker {
                "amqp" => {
                    let queue = TestQueue::new("idemgate_bench").await;
                    for i in 0..n {
                        queue.publish(Some(&format!("b{i}")), &order(i, "")).await;
                    }
                    let rate = if let Some(store) = dedup {
                        let c = consumer(amqp(&queue.name, 32), &[]);
                        timed(n, &handler, || async {
                            Replica::start(dir.path(), 0, &handler, c, store).await
                        })
                        .await
                    } else {
                        timed(n, &handler, || plain_amqp(&queue.name, handler.addr)).await
                    };
                    queue.delete().await;
                    (rate, handler.counts().len())
                }
                _ => {
                    let stream = TestStream::new(NATS_URL, "idemgate_bench").await;
                    for i in 0..n {
                        let k = format!("b{i}");
                        stream
                            .publish(None, &[("x-order-id", &k)], &order(i, ""))
                            .await;
                    }
                    let rate = if let Some(store) = dedup {
                        let mut source = jetstream(NATS_URL, &stream, "30s");
                        source["jetstream"]["max_ack_pending"] = Value::Integer(32);
                        let c = consumer(source, &[("key", table(&[("header", s("x-order-id"))]))]);
                        timed(n, &handler, || async {
                            Replica::start(dir.path(), 0, &handler, c, store).await
                        })
                        .await
                    } else {
                        timed(n, &handler, || plain_jetstream(&stream, handler.addr)).await
                    };
                    stream.delete().await;
                    (rate, handler.counts().len())
                }
            };
            assert_eq!(keys, n);
            let what = match dedup {
                Some(Store::Postgres(_)) => "idemgate consumer, postgres",
                Some(_) => "idemgate consumer, sqlite",
                None => "plain consumer, no dedup",
            };
            rows.push(format!("| {broker} | {what} | {n} | {rate:.0} |"));
        }
    }
    println!("| broker | consumer | messages | messages/s |\n|---|---|---:|---:|");
    for r in rows {
        println!("{r}");
    }
}

/// Starts a consumer with `start` and measures how fast the `n` queued
/// messages are executed: from the first execution to the last, so a
/// consumer's start-up (idemgate's process, the connection, the store's
/// migration) is not counted against it.
async fn timed<F, Fut, T>(n: usize, handler: &Handler, start: F) -> f64
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let _running = start().await;
    let mut first = None;
    loop {
        let done = handler.counts().len();
        if done > 0 && first.is_none() {
            first = Some((std::time::Instant::now(), done));
        }
        if done >= n {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the bench did not finish in 120 s"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let (began, already) = first.expect("at least one execution");
    (n - already) as f64 / began.elapsed().as_secs_f64().max(1e-6)
}

type BenchClient = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Full<bytes::Bytes>,
>;

fn bench_client() -> BenchClient {
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http()
}

async fn post(client: &BenchClient, upstream: std::net::SocketAddr, key: &str, body: bytes::Bytes) {
    let req = http::Request::post(format!("http://{upstream}/reserve"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(body))
        .unwrap();
    let resp = client.request(req).await.expect("the upstream answers");
    let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
}

/// The same consumer without dedup: consume (prefetch 32), POST, ack.
async fn plain_amqp(queue: &str, upstream: std::net::SocketAddr) -> tokio::task::JoinHandle<()> {
    use futures_util::StreamExt;
    let conn = crate::support::brokers::rabbitmq(AMQP_URL).await;
    let channel = conn.create_channel().await.unwrap();
    channel
        .basic_qos(32, lapin::options::BasicQosOptions::default())
        .await
        .unwrap();
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "bench-plain".into(),
            lapin::options::BasicConsumeOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    tokio::spawn(async move {
        let _conn = conn;
        let client = bench_client();
        while let Some(Ok(d)) = consumer.next().await {
            let client = client.clone();
            tokio::spawn(async move {
                let key = d
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|k| k.to_string())
                    .unwrap_or_default();
                post(&client, upstream, &key, bytes::Bytes::from(d.data.clone())).await;
                let _ = d
                    .acker
                    .ack(lapin::options::BasicAckOptions::default())
                    .await;
            });
        }
    })
}

/// The same consumer without dedup on JetStream: pull (max_ack_pending
/// 32), POST, double ack.
async fn plain_jetstream(
    stream: &TestStream,
    upstream: std::net::SocketAddr,
) -> tokio::task::JoinHandle<()> {
    use futures_util::StreamExt;
    let s = stream.js.get_stream(&stream.name).await.unwrap();
    let c: async_nats::jetstream::consumer::PullConsumer = s
        .get_or_create_consumer(
            "bench-plain",
            async_nats::jetstream::consumer::pull::Config {
                durable_name: Some("bench-plain".into()),
                max_ack_pending: 32,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let mut messages = c.messages().await.unwrap();
    tokio::spawn(async move {
        let client = bench_client();
        while let Some(Ok(m)) = messages.next().await {
            let client = client.clone();
            tokio::spawn(async move {
                let key = m
                    .message
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("x-order-id"))
                    .map(|v| v.to_string())
                    .unwrap_or_default();
                post(&client, upstream, &key, m.message.payload.clone()).await;
                let _ = m.double_ack().await;
            });
        }
    })
}

// ===== known defects =====

/// A JetStream dead letter whose `+TERM` was lost after its copy was
/// stored (a broker restart or a dropped connection between the two):
/// the redelivery publishes the copy again under the same `Nats-Msg-Id`
/// (`idemgate-dl-<stream>-<sequence>`, meant to store it once), the
/// dead-letter stream answers `duplicate`, and idemgate treats that as a
/// failed publish: it does not `+TERM`, so the message comes back every
/// `ack_wait` for the dead-letter stream's whole duplicate window (2 min
/// by default) and is then stored a second time. The lost `+TERM` is
/// simulated by storing that copy first, exactly as the lost attempt
/// would have. Expected: the message is termed, one dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_dead_letter_whose_term_was_lost_is_termed_on_its_redelivery() {
    let handler = Handler::start().await;
    let stream = TestStream::new(NATS_URL, "idemgate_dlterm").await;
    let dir = tempfile::TempDir::new().unwrap();
    // The copy an earlier delivery of the stream's first message stored.
    let mut h = async_nats::HeaderMap::new();
    h.insert(
        "Nats-Msg-Id",
        format!("idemgate-dl-{}-1", stream.name).as_str(),
    );
    h.insert("Idemgate-Dead-Letter-Reason", "rejected");
    h.insert("x-order-id", "k1");
    stream
        .js
        .publish_with_headers(
            stream.dead_subject.clone(),
            h,
            bytes::Bytes::from_static(br#"{"plan":[422]}"#),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    stream
        .publish(None, &[("x-order-id", "k1")], r#"{"plan":[422]}"#)
        .await;
    let c = consumer(
        jetstream(NATS_URL, &stream, "1s"),
        &[("key", table(&[("header", s("x-order-id"))]))],
    );
    let replica = Replica::start(dir.path(), 0, &handler, c, Store::Memory).await;
    wait_executed(&handler, &["k1".to_string()]).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(8);
    let mut counts = stream.consumer_counts(CONSUMER).await;
    while counts != Some((0, 0)) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        counts = stream.consumer_counts(CONSUMER).await;
    }
    let log = replica.p().log();
    drop(replica);
    let dead = stream.dead_letters().await;
    stream.delete().await;
    assert_eq!(
        counts,
        Some((0, 0)),
        "the dead-lettered message is still (pending, unacked) 8 s later (ack_wait 1 s): its +TERM never came; log:\n{log}"
    );
    assert_eq!(dead.len(), 1, "one dead letter: {dead:?}");
}

// ===== review fixes: AMQP timeouts, settling, retry copies, holds, shutdown, refusals =====

/// The fatal path: a consumer the broker's side refuses at start-up (a
/// dead-letter subject its stream captures, review H1; an existing
/// durable with a `max_deliver` limit, review M3) fails `idemgate serve`
/// (exit non-zero, the consumer and the setting named), as a config
/// error does, instead of running with the consumer down for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_fails_when_the_broker_refuses_a_consumer_at_start_up() {
    use async_nats::jetstream::consumer::{pull, AckPolicy};
    let handler = Handler::start().await;
    let dir = tempfile::TempDir::new().unwrap();
    let run = |source: Value, tag: &str| {
        let (listen, admin) = (free_port(), free_port());
        let c = consumer(source, &[("key", table(&[("header", s("x-order-id"))]))]);
        let path = dir.path().join(format!("{tag}.toml"));
        TestConfig::new(handler.addr)
            .listen(listen, admin)
            .set("store.backend", "memory")
            .set("consumer", Value::Array(vec![c]))
            .write(&path);
        async move {
            let path = path.display().to_string();
            run_to_completion(&["serve", "--config", &path], &[]).await
        }
    };
    let stream = TestStream::new(NATS_URL, "idemgate_fatal_dl").await;
    let mut source = jetstream(NATS_URL, &stream, "5s");
    source["jetstream"]["dead_letter_subject"] = s(&format!("{}.in", stream.name));
    let out = run(source, "dl").await;
    assert_ne!(out.code, 0, "{out:?}");
    assert!(
        out.stderr.contains(&format!("consumer \"{CONSUMER}\""))
            && out.stderr.contains("dead_letter_subject"),
        "{}",
        out.stderr
    );
    stream.delete().await;
    let stream = TestStream::new(NATS_URL, "idemgate_fatal_durable").await;
    stream
        .js
        .get_stream(&stream.name)
        .await
        .unwrap()
        .create_consumer(pull::Config {
            durable_name: Some(CONSUMER.to_string()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(5),
            max_deliver: 5,
            ..Default::default()
        })
        .await
        .unwrap();
    let out = run(jetstream(NATS_URL, &stream, "5s"), "durable").await;
    assert_ne!(out.code, 0, "{out:?}");
    assert!(
        out.stderr.contains(&format!("consumer \"{CONSUMER}\""))
            && out.stderr.contains("max_deliver 5"),
        "{}",
        out.stderr
    );
    assert!(handler.counts().is_empty());
    stream.delete().await;
}
/// `rabbitmqctl -n node <args>`, which must succeed.
fn rabbitmqctl_on(node: &str, args: &[&str]) {
    let out = std::process::Command::new("rabbitmqctl")
        .args(["-q", "-n", node])
        .args(args)
        .output()
        .expect("run rabbitmqctl");
    assert!(out.status.success(), "rabbitmqctl {args:?}: {out:?}");
}

/// Whether `node` has a resource alarm in effect.
fn alarm_on(node: &str) -> bool {
    let out = std::process::Command::new("rabbitmq-diagnostics")
        .args(["-q", "-n", node, "check_alarms"])
        .output()
        .expect("run rabbitmq-diagnostics");
    !out.status.success()
}

/// [`wait_for`] with a longer deadline, for waits that include an
/// operation timeout of idemgate's; a timeout shows `replica`'s log.
async fn wait_long<T, F, Fut>(what: &str, deadline: Duration, replica: &Replica, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let until = tokio::time::Instant::now() + deadline;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "timed out waiting for {what}:\n{}",
            replica.p().log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Review L4: an ack lapin did not send (`Ok(false)`: the delivery's
/// channel closed while the upstream ran) was taken as done, silently.
/// It is now logged and counted; the redelivery is answered from the
/// record, so the message still runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_an_ack_lapin_did_not_send_is_logged_and_counted() {
    let handler = Handler::start().await;
    let queue = TestQueue::new("idemgate_unsent").await;
    let dir = tempfile::TempDir::new().unwrap();
    let c = consumer(amqp(&queue.name, 1), &[]);
    let replica = Replica::start(dir.path(), 0, &handler, c, Store::Sqlite).await;
    // Long enough for two rabbitmqctl runs on a loaded machine.
    queue.publish(Some("u1"), r#"{"delay_ms":5000}"#).await;
    wait_for("the delivery to reach the handler", || async {
        (replica.counter("in_flight", None).await == 1).then_some(())
    })
    .await;
    close_idemgate_connection(&queue.name);
    wait_for("the unsent ack to be counted", || async {
        (replica.counter("fates_not_told_total", None).await >= 1).then_some(())
    })
    .await;
    let log = replica.p().log();
    assert!(
        log.lines()
            .any(|l| l.contains("basic.ack not sent") && l.contains(CONSUMER)),
        "{log}"
    );
    wait_for("the redelivery to be answered from the record", || async {
        (replica.counter("duplicates_suppressed_total", None).await == 1).then_some(())
    })
    .await;
    wait_for("the queue to end empty, nothing unacked", || async {
        (rabbitmq_counts(&queue.name) == (0, 0)).then_some(())
    })
    .await;
    assert_once(&handler, &["u1".to_string()]);
    drop(replica);
    queue.delete().await;
}

/// Review M5: a memory alarm on a private RabbitMQ node blocks the
/// connection once a retry republishes its copy; lapin then writes
/// nothing more (acks included), and the confirm never came. The
/// operation now times out: the connection is given up (logged once,
/// naming the consumer), its unacked deliveries return, and a new
/// connection finishes every message during the alarm (acks from a
/// connection that does not publish are still read). After the alarm:
/// nothing lost, nothing run twice, the consumer still consuming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_a_connection_blocked_by_an_alarm_is_given_up_and_loses_nothing() {
    let rabbit = PrivateRabbit::start().await;
    let url = rabbit.url();
    let handler = Handler::start().await;
    let queue = TestQueue::on(&url, "idemgate_alarm").await;
    let dir = tempfile::TempDir::new().unwrap();
    let mut keys = vec!["kr".to_string()];
    queue.publish(Some("kr"), r#"{"plan":[503,201]}"#).await;
    for i in 0..20 {
        let k = format!("a{i}");
        queue.publish(Some(&k), &order(i, ",\"delay_ms\":20")).await;
        keys.push(k);
    }
    rabbitmqctl_on(&rabbit.node, &["set_vm_memory_high_watermark", "0"]);
    wait_for("the memory alarm", || async {
        alarm_on(&rabbit.node).then_some(())
    })
    .await;
    let c = consumer(amqp_at(&url, &queue.name, 4), &[]);
    let replica = Replica::start(dir.path(), 0, &handler, c, Store::Sqlite).await;
    wait_long(
        "every message to run during the alarm",
        Duration::from_secs(90),
        &replica,
        || async {
            let counts = handler.counts();
            let done =
                keys.iter().all(|k| counts.contains_key(k)) && handler.runs("kr") == [503, 201];
            done.then_some(())
        },
    )
    .await;
    wait_long(
        "the queue to be empty during the alarm",
        Duration::from_secs(30),
        &replica,
        || async { (rabbitmq_counts_on(&rabbit.node, &queue.name) == (0, 0)).then_some(()) },
    )
    .await;
    assert!(alarm_on(&rabbit.node));
    let log = replica.p().log();
    let given_up: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("no answer from RabbitMQ within"))
        .collect();
    assert!(!given_up.is_empty(), "{log}");
    assert!(given_up.iter().all(|l| l.contains(CONSUMER)), "{log}");
    rabbitmqctl_on(&rabbit.node, &["set_vm_memory_high_watermark", "0.4"]);
    wait_for("the alarm to clear", || async {
        (!alarm_on(&rabbit.node)).then_some(())
    })
    .await;
    queue.publish(Some("after"), &order(99, "")).await;
    keys.push("after".to_string());
    wait_executed(&handler, &keys).await;
    wait_for("the queue to end empty, nothing unacked", || async {
        (rabbitmq_counts_on(&rabbit.node, &queue.name) == (0, 0)).then_some(())
    })
    .await;
    let counts = handler.counts();
    let twice: Vec<_> = counts
        .iter()
        .filter(|(k, n)| **n != 1 && k.as_str() != "kr")
        .collect();
    assert!(twice.is_empty(), "executed other than once: {twice:?}");
    assert_eq!(handler.runs("kr"), [503, 201]);
    assert!(queue.drain_dead_letters().await.is_empty());
    assert_eq!(replica.counter("broker_up", None).await, 1);
    drop(replica);
}
/// Review L5: the retry copy is published `mandatory`. With the queue
/// deleted while the delivery is held, the copy comes back unroutable;
/// that was taken as published (and the original acked). Now it is a
/// failure: the original is requeued, not acked, and it is logged and
/// counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_a_returned_retry_copy_is_a_failure_not_an_ack() {
    let handler = Handler::start().await;
    let queue = TestQueue::new("idemgate_returned").await;
    let dir = tempfile::TempDir::new().unwrap();
    // Prefetch 1: the runner waits for the held delivery before it sees
    // the broker cancel the consumer.
    let c = consumer(
        amqp(&queue.name, 1),
        &[
            ("lease", s("10s")),
            ("retry_initial", s("6s")),
            ("retry_max", s("6s")),
        ],
    );
    let replica = Replica::start(dir.path(), 0, &handler, c, Store::Sqlite).await;
    queue.publish(Some("k1"), r#"{"plan":[503,201]}"#).await;
    wait_for("the first attempt", || async {
        (handler.runs("k1") == [503]).then_some(())
    })
    .await;
    queue
        .channel
        .queue_delete(
            lapin::types::ShortString::from(queue.name.clone()),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await
        .unwrap();
    wait_for("the returned copy in the log", || async {
        let log = replica.p().log();
        log.lines()
            .find(|l| {
                l.contains("the retry copy was not published")
                    && l.contains("returned by the broker")
                    && l.contains(CONSUMER)
            })
            .map(drop)
    })
    .await;
    assert!(replica.counter("fates_not_told_total", None).await >= 1);
    assert_eq!(handler.runs("k1"), [503]);
    drop(replica);
    queue.delete().await;
}
/// Review L9: a backoff longer than the lease held the delivery (and its
/// prefetch slot) for all of it. Now it is held at most the lease, then
/// sent back with when its backoff ends: with prefetch 1, the next
/// message runs meanwhile, and the held one still waits out its backoff.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_a_backoff_longer_than_the_lease_frees_the_prefetch_slot() {
    let handler = Handler::start().await;
    let queue = TestQueue::new("idemgate_hold").await;
    let dir = tempfile::TempDir::new().unwrap();
    // The backoff: between 4 s and 8 s (equal jitter); the lease 1 s.
    let c = consumer(
        amqp(&queue.name, 1),
        &[("retry_initial", s("8s")), ("retry_max", s("8s"))],
    );
    let replica = Replica::start(dir.path(), 0, &handler, c, Store::Sqlite).await;
    queue.publish(Some("slow"), r#"{"plan":[503,201]}"#).await;
    queue.publish(Some("next"), r#"{"plan":[201]}"#).await;
    wait_for("the first attempt", || async {
        (handler.runs("slow") == [503]).then_some(())
    })
    .await;
    let first = tokio::time::Instant::now();
    wait_for("the next message", || async {
        (handler.runs("next") == [201]).then_some(())
    })
    .await;
    assert!(
        first.elapsed() < Duration::from_secs(3),
        "the slot was held {:?}",
        first.elapsed()
    );
    assert_eq!(handler.runs("slow"), [503], "its backoff is not over");
    wait_for("the second attempt", || async {
        (handler.runs("slow") == [503, 201]).then_some(())
    })
    .await;
    assert!(
        first.elapsed() >= Duration::from_millis(3800),
        "ran again after {:?}, before its backoff (>= 4 s)",
        first.elapsed()
    );
    wait_for("the queue to end empty, nothing unacked", || async {
        (rabbitmq_counts(&queue.name) == (0, 0)).then_some(())
    })
    .await;
    assert_eq!(handler.runs("next"), [201]);
    assert!(replica.counter("messages_retried_total", None).await >= 2);
    drop(replica);
    queue.delete().await;
}
/// Review L3: finishing the deliveries in flight and closing each had
/// their own `shutdown_grace`, so a handler slower than the grace kept
/// the process twice as long. All of it now ends by one deadline; the
/// unfinished message goes back to the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_shutdown_with_a_handler_slower_than_the_grace_takes_one_grace() {
    let handler = Handler::start().await;
    let queue = TestQueue::new("idemgate_grace").await;
    let dir = tempfile::TempDir::new().unwrap();
    let c = consumer(amqp(&queue.name, 1), &[("lease", s("30s"))]);
    let mut replica = Replica::start(dir.path(), 0, &handler, c, Store::Sqlite).await;
    queue.publish(Some("s1"), r#"{"delay_ms":20000}"#).await;
    wait_for("the delivery to reach the handler", || async {
        (replica.counter("in_flight", None).await == 1).then_some(())
    })
    .await;
    let mut p = replica.process.take().unwrap();
    let asked = tokio::time::Instant::now();
    p.terminate();
    let code = p.exited().await;
    let took = asked.elapsed();
    // shutdown_grace is 3 s (Replica::start).
    assert!(took < Duration::from_millis(4800), "shutdown took {took:?}");
    assert_eq!(code, Some(0), "{}", p.log());
    assert!(
        p.log()
            .contains("grace period over with deliveries in flight"),
        "{}",
        p.log()
    );
    wait_for("the message back in the queue", || async {
        (rabbitmq_counts(&queue.name) == (1, 0)).then_some(())
    })
    .await;
    queue.delete().await;
}
