//! PostgreSQL beyond the defaults.
//!
//! Serialization failures and deadlocks (SQLSTATE 40001, 40P01) are run
//! again inside the store call instead of failing it. Provoked for real:
//! with `default_transaction_isolation = serializable` (set through the
//! URL's `options`, as a distributed engine or a cautious DBA would have
//! it), concurrent claims of one fresh key make PostgreSQL abort all but
//! one `INSERT ... ON CONFLICT DO UPDATE` with "could not serialize access
//! due to concurrent update".
//!
//! `store.migration_lock = "none"` (engines without advisory locks).

use crate::support::services::{database_url, drop_schema, pg_store_config, unique_schema};
use idemgate::idempotency::{Fingerprint, RecordKey, Scope};
use idemgate::store::postgres::PostgresStore;
use idemgate::store::{Claim, ClaimOutcome, LeaseToken, Store};
use std::sync::Arc;

fn with_query(url: &str, query: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{query}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_under_serializable_isolation_get_answers_not_errors() {
    let url = with_query(
        &database_url(),
        "options=-c%20default_transaction_isolation%3Dserializable",
    );
    let schema = unique_schema("t");
    // Separate stores (separate pools): no batching across them, so the
    // claims race in the database.
    let mut stores = Vec::new();
    for _ in 0..4 {
        let store = PostgresStore::connect(&pg_store_config(&url, &schema))
            .await
            .expect("store");
        store.migrate().await.expect("migrate");
        stores.push(Arc::new(store));
    }
    let isolation = {
        let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("connect");
        let task = tokio::spawn(conn);
        let row = client
            .query_one("SHOW default_transaction_isolation", &[])
            .await
            .expect("show");
        drop(client);
        let _ = task.await;
        row.get::<_, String>(0)
    };
    assert_eq!(isolation, "serializable", "the URL's options apply");

    for round in 0..30 {
        let key = RecordKey {
            scope: Scope(rand::random()),
            key: rand::random(),
        };
        let fingerprint = Fingerprint(rand::random());
        let claims = stores.iter().map(|store| {
            let store = store.clone();
            let claim = Claim {
                key,
                fingerprint,
                token: LeaseToken::random(),
                now: idemgate::clock::Clock::system().now_millis(),
                lease_ms: 10_000,
                ttl_ms: 60_000,
                first_use: Some(idemgate::store::FirstUse::new("POST", "/orders")),
            };
            tokio::spawn(async move { store.claim(&claim).await })
        });
        let answers = futures_util::future::join_all(claims).await;
        let mut claimed = 0;
        for answer in answers {
            match answer.expect("claim task") {
                Ok(ClaimOutcome::Claimed { .. }) => claimed += 1,
                Ok(ClaimOutcome::Existing(_)) => {}
                Err(err) => panic!("round {round}: a claim failed instead of being retried: {err}"),
            }
        }
        assert_eq!(claimed, 1, "round {round}: exactly one claim wins");
    }
    drop_schema(&database_url(), &schema).await;
}

/// `store.migration_lock = "none"` (for engines without advisory locks or
/// transactional DDL): migrations and sweeps take no advisory lock and the
/// whole store contract still holds. Only plain PostgreSQL runs here; see
/// docs/book/src/deploy.md for what was verified on which engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_store_contract_holds_without_advisory_locks() {
    use idemgate::config::MigrationLock;
    let schema = unique_schema("t");
    let store = |offset_ms| {
        let mut cfg = pg_store_config(&database_url(), &schema);
        cfg.migration_lock = MigrationLock::None;
        async move {
            Arc::new(
                PostgresStore::connect(&cfg)
                    .await
                    .expect("store")
                    .with_clock_offset(offset_ms),
            )
        }
    };
    let first = store(0).await;
    let all = idemgate::store::postgres::MIGRATIONS.len() as u32;
    assert_eq!(first.migrate().await.expect("migrate"), all);
    assert_eq!(first.migrate().await.expect("migrate again"), 0);
    let later = store(crate::store_contract::LATER_MS).await;
    crate::store_contract::run_contract(first, later).await;
    drop_schema(&database_url(), &schema).await;
}
