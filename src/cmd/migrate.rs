//! `idemgate migrate`: the PostgreSQL schema brought up to date.

use crate::config::{Backend, Config};

/// `idemgate migrate`: applies the PostgreSQL migrations.
pub async fn run(config: Config) -> anyhow::Result<()> {
    if config.restart.store.backend != Backend::Postgres {
        outln!(
            "store.backend = \"{}\": its schema is created when it is opened; nothing to migrate",
            config.restart.store.backend.as_str()
        );
        return Ok(());
    }
    let applied = crate::store::migrate(&config).await?;
    outln!(
        "schema {:?} is current ({applied} migration(s) applied now)",
        config.restart.store.schema
    );
    Ok(())
}
