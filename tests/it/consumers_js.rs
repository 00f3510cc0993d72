//! JetStream consumers and their config, against the real broker and
//! stores (consumer review findings; L8 is a row of the config unit
//! table): the memory store warned about.

use crate::consumers::{consumer, jetstream, s, table, Replica, Store, CONSUMER};
use crate::support::brokers::{Handler, TestStream, NATS_URL};
use crate::support::{run_on_config_text, wait_for};

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
