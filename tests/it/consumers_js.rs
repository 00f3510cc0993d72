//! JetStream consumers and their config, against the real broker and
//! stores (review findings L2, L6, L7; L8 is a row of the config unit
//! table): progress only while the claim's lease is ours, a key in flight
//! elsewhere not using up `max_attempts`, the memory store warned about.

use crate::consumers::{consumer, jetstream, s, table, Replica, Store, CONSUMER};
use crate::support::brokers::{Handler, TestStream, NATS_URL};
use crate::support::services::{database_url, pg_store_config, require_postgres};
use crate::support::{run_on_config_text, run_to_completion, wait_for, TestSchema};
use async_nats::jetstream::consumer::PullConsumer;
use idemgate::idempotency::{Fingerprint, IdempotencyKey, RecordKey, Scope};
use idemgate::store::postgres::PostgresStore;
use idemgate::store::{Claim, ClaimOutcome, Fence, LeaseToken, Store as _};
use std::time::Duration;
use toml::Value;

/// How many times the broker delivered the durable's messages, first
/// deliveries and redeliveries together.
async fn delivered(stream: &TestStream) -> u64 {
    let s = stream.js.get_stream(&stream.name).await.unwrap();
    let mut c: PullConsumer = s.get_consumer(CONSUMER).await.unwrap();
    c.info().await.unwrap().delivered.consumer_sequence
}

async fn keys(args: &[&str], replica: &Replica) -> crate::support::Run {
    let config = replica.config.display().to_string();
    let mut all = vec!["keys"];
    all.extend_from_slice(args);
    all.extend(["--consumer", CONSUMER, "k1", "--config", &config]);
    run_to_completion(&all, &[]).await
}

/// Pins consumer review L2: `+WPI` went out on a timer while the upstream
/// ran, whether or not the claim was still ours, so a delivery whose
/// lease was lost kept the broker from redelivering until its upstream
/// call ended. Now progress follows the lease: once a renewal finds the
/// claim gone (here an operator deletes the in-flight key, which a
/// takeover looks like to the holder), no more `+WPI`, and the broker
/// redelivers within `ack_wait` while the first call still runs. The
/// first delivery's completion is refused and never acked; the
/// redelivery's is recorded and acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_progress_stops_once_the_lease_is_lost_so_the_broker_redelivers() {
    let handler = Handler::start().await;
    let stream = TestStream::new(NATS_URL, "idemgate_lost").await;
    let dir = tempfile::TempDir::new().unwrap();
    // lease 1s: renewed every third of it; ack_wait 2s: +WPI every 1s.
    let c = consumer(
        jetstream(NATS_URL, &stream, "2s"),
        &[("key", table(&[("header", s("x-order-id"))]))],
    );
    let replica = Replica::start(dir.path(), 0, &handler, c, Store::Sqlite).await;
    stream
        .publish(None, &[("x-order-id", "k1")], r#"{"delay_ms":7000}"#)
        .await;
    wait_for("the key in flight", || async {
        let shown = keys(&["show"], &replica).await;
        shown.stdout.contains("in_flight").then_some(())
    })
    .await;
    // Progress kept the message while the lease was ours.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        delivered(&stream).await,
        1,
        "redelivered under a live lease"
    );
    let deleted = keys(&["delete"], &replica).await;
    assert_eq!(deleted.code, 0, "{deleted:?}");
    let redelivered = wait_for("a redelivery, or the first call's end", || async {
        if delivered(&stream).await >= 2 {
            return Some(true);
        }
        (!handler.runs("k1").is_empty()).then_some(false)
    })
    .await;
    assert!(
        redelivered,
        "the first call ended before the broker redelivered: progress outlived the lease"
    );
    assert!(handler.runs("k1").is_empty(), "the first call still runs");
    wait_for("both calls to end, and the message acked", || async {
        let done =
            handler.runs("k1").len() == 2 && stream.consumer_counts(CONSUMER).await == Some((0, 0));
        done.then_some(())
    })
    .await;
    let log = replica.p().log();
    assert!(
        log.contains("completion refused: the lease ran out and another request took the key over"),
        "{log}"
    );
    assert!(stream.dead_letters().await.is_empty());
    assert_eq!(
        replica
            .counter("messages_dead_lettered_total", Some("exhausted"))
            .await,
        0
    );
    drop(replica);
    stream.delete().await;
}

/// Pins consumer review L6: a JetStream delivery whose key was in flight
/// elsewhere was nak'd, and each redelivery counted in `num_delivered`,
/// the attempt number `max_attempts` is checked against: a message whose
/// key another claim held for a while was dead-lettered `exhausted` at
/// its first real attempt. Now such a delivery is held (with progress)
/// and claimed again, adding no delivery: with `max_attempts = 2`, the
/// key held by another claim for several retry periods and past
/// `ack_wait`, then released, the message runs its two attempts (503,
/// then 201) and is acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_key_in_flight_elsewhere_does_not_use_up_max_attempts() {
    let url = database_url();
    require_postgres(&url).await;
    let schema = TestSchema::new();
    let handler = Handler::start().await;
    let stream = TestStream::new(NATS_URL, "idemgate_busy").await;
    let dir = tempfile::TempDir::new().unwrap();
    let c = consumer(
        jetstream(NATS_URL, &stream, "2s"),
        &[
            ("key", table(&[("header", s("x-order-id"))])),
            ("max_attempts", Value::Integer(2)),
        ],
    );
    let replica = Replica::start(dir.path(), 0, &handler, c, Store::Postgres(&schema)).await;
    // Another claim on the message's key, as idemgate makes it: the
    // consumer's name is the scope; the fingerprint covers the method,
    // the path and the payload.
    let body = r#"{"plan":[503,201]}"#;
    let store = PostgresStore::connect(&pg_store_config(&url, &schema.schema))
        .await
        .unwrap();
    let key = RecordKey::new(
        Scope::of_value(CONSUMER, None),
        &IdempotencyKey::from_value("k1").unwrap(),
    );
    let token = LeaseToken::random();
    let claim = Claim {
        key,
        fingerprint: Fingerprint::compute(
            &http::Method::POST,
            "/reserve",
            None,
            &[],
            body.as_bytes(),
        ),
        token,
        now: idemgate::clock::Clock::system().now_millis(),
        lease_ms: 60_000,
        ttl_ms: 3_600_000,
        first_use: None,
    };
    assert!(matches!(
        store.claim(&claim).await.unwrap(),
        ClaimOutcome::Claimed { .. }
    ));
    stream.publish(None, &[("x-order-id", "k1")], body).await;
    // Several retry periods (retry_max 400ms) and longer than ack_wait.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(handler.runs("k1").is_empty(), "ran while held elsewhere");
    assert_eq!(store.release(&key, &token).await.unwrap(), Fence::Held);
    let settled = wait_for("the message to be acked or dead-lettered", || async {
        let dead = replica
            .counter("messages_dead_lettered_total", Some("exhausted"))
            .await
            + replica
                .counter("messages_dead_lettered_total", Some("mismatch"))
                .await;
        if dead > 0 {
            return Some(false);
        }
        let acked = handler.runs("k1") == [503, 201]
            && stream.consumer_counts(CONSUMER).await == Some((0, 0));
        acked.then_some(true)
    })
    .await;
    assert!(
        settled,
        "dead-lettered after {:?}: {:?}",
        handler.runs("k1"),
        stream.dead_letters().await
    );
    assert_eq!(handler.runs("k1"), [503, 201]);
    assert!(stream.dead_letters().await.is_empty());
    drop(replica);
    stream.delete().await;
}

/// Pins consumer review L7: `store.backend = "memory"` was accepted with
/// consumers in silence, though a restart forgets every record and the
/// broker then redelivers what was unacked (run again). `check-config`
/// and `serve`'s start-up log warn, naming the consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_store_with_a_consumer_is_warned_about_at_start_and_by_check_config() {
    let want = format!(
        "consumer \"{CONSUMER}\": store.backend = \"memory\" forgets every record on restart"
    );
    let text = format!(
        "[server]\nupstream = \"http://127.0.0.1:3000\"\n[store]\nbackend = \"memory\"\n[[consumer]]\nname = \"{CONSUMER}\"\nsource = {{ jetstream = {{ url = \"{NATS_URL}\", stream = \"S\", durable = \"d\" }} }}\ndeliver = {{ path = \"/reserve\" }}\n"
    );
    let (run, _) = run_on_config_text(&["check-config"], &text, &[]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout.contains(&format!("warning: {want}")),
        "{}",
        run.stdout
    );
    let durable = text.replace("backend = \"memory\"", "backend = \"sqlite\"");
    let (run, _) = run_on_config_text(&["check-config"], &durable, &[]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        !run.stdout.contains("forgets every record"),
        "{}",
        run.stdout
    );

    let handler = Handler::start().await;
    let stream = TestStream::new(NATS_URL, "idemgate_memwarn").await;
    let dir = tempfile::TempDir::new().unwrap();
    let c = consumer(
        jetstream(NATS_URL, &stream, "5s"),
        &[("key", table(&[("header", s("x-order-id"))]))],
    );
    let replica = Replica::start(dir.path(), 0, &handler, c, Store::Memory).await;
    wait_for("the warning in the start-up log", || async {
        replica.p().log().contains(&want).then_some(())
    })
    .await;
    drop(replica);
    stream.delete().await;
}
