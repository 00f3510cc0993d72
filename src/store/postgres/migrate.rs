//! The schema: embedded, versioned migrations, run once per process
//! before the first call (a proxy started while PostgreSQL was down
//! creates its tables when the database comes back), under an advisory
//! lock so replicas wait for each other (`store.migration_lock`).

use super::pool::{quote_ident, Core, InUse};
use super::MIGRATIONS;
use crate::config::MigrationLock;
use crate::store::StoreError;
use deadpool_postgres::ClientWrapper;
use tokio_postgres::types::Type;

/// First key of the two-int advisory locks; the second is `hashtext(schema)`
/// so replicas sharing a database but not a schema do not serialize.
const MIGRATION_LOCK: i32 = 0x1de6_0001;

impl Core {
    pub(super) async fn migrate(&self) -> Result<u32, StoreError> {
        let applied = self.run_migrations().await?;
        let _ = self.migrated.set(());
        Ok(applied)
    }

    pub(super) async fn run_migrations(&self) -> Result<u32, StoreError> {
        let client = InUse(Some(self.pool.get().await.map_err(|e| self.pool_err(e))?));
        // Migrations run rarely: unnamed statements in every mode, so the
        // one code path works behind a pooler too.
        let locked = self.migration_lock == MigrationLock::Advisory;
        let on: &ClientWrapper = &client;
        let res = self.unit(on, locked, || self.migrate_on(on, locked)).await;
        let applied = self.settle(client, Ok(res))?;
        if applied > 0 {
            tracing::info!(schema = %self.schema, applied, "postgres migrations applied");
        }
        self.tell_commit().await;
        Ok(applied)
    }

    /// The migrations, inside [`Core::unit`]'s transaction when `locked`
    /// (then under the advisory lock, so replicas wait for each other);
    /// without it each statement commits on its own.
    pub(super) async fn migrate_on(
        &self,
        client: &ClientWrapper,
        locked: bool,
    ) -> Result<u32, tokio_postgres::Error> {
        let schema = quote_ident(&self.schema);
        if locked {
            client
                .query_typed(
                    "SELECT pg_advisory_xact_lock($1, hashtext($2))",
                    &[(&MIGRATION_LOCK, Type::INT4), (&self.schema, Type::TEXT)],
                )
                .await?;
        }
        // Checked first: CREATE SCHEMA IF NOT EXISTS still needs the CREATE
        // privilege, which a role given a ready-made schema may lack.
        let exists = !client
            .query_typed(
                "SELECT 1 FROM pg_namespace WHERE nspname = $1",
                &[(&self.schema, Type::TEXT)],
            )
            .await?
            .is_empty();
        if !exists {
            client
                .batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
                .await?;
        }
        client
            .batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS {schema}.idemgate_migrations (\
                   version int PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
            ))
            .await?;
        let current: i32 = client
            .query_typed(
                &format!("SELECT coalesce(max(version), 0) FROM {schema}.idemgate_migrations"),
                &[],
            )
            .await?
            .first()
            .map(|row| row.get(0))
            .unwrap_or(0);
        let mut applied = 0;
        for (i, sql) in MIGRATIONS.iter().enumerate() {
            let version = i as i32 + 1;
            if version <= current {
                continue;
            }
            client
                .batch_execute(&sql.replace("{schema}", &schema))
                .await?;
            client
                .execute_typed(
                    &format!(
                        "INSERT INTO {schema}.idemgate_migrations (version, applied_at) VALUES ($1, now())"
                    ),
                    &[(&version, Type::INT4)],
                )
                .await?;
            applied += 1;
        }
        Ok(applied)
    }
}
