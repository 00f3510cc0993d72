//! The SQL that SQLite and PostgreSQL share, side by side: the table layout,
//! the record rules as predicates, and every statement's text.
//!
//! Statements are written once, in PostgreSQL's placeholder style (`$1`),
//! and [`Statements::new`] turns them into SQLite's (`?1`). The only other
//! differences are spelled out where they occur: the table name (schema
//! qualified in PostgreSQL), and the sweep's row selection (`ctid ... FOR
//! UPDATE SKIP LOCKED` in PostgreSQL, the primary key in SQLite). Column
//! types differ too (BLOB/INTEGER vs bytea/bigint), but only in the
//! migrations, which are frozen text: see [`SQLITE_MIGRATIONS`].
//!
//! Every statement binds a record's key as `$1` (scope) and `$2` (key);
//! the fenced ones add the holder's token as `$3` ([`OwnerParams`]).

use super::LeaseToken;
use crate::idempotency::RecordKey;

/// Which SQL backend a statement is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dialect {
    Sqlite,
    Postgres,
}

// === table layout ===
//
// The two migration lists are literal text, not generated from one column
// list: a migration that shipped has run in users' databases and must never
// change, so a later edit to a shared template must not reach it. New
// layout changes are new entries, appended to both lists.

/// SQLite's ordered schema migrations; `PRAGMA user_version` records how
/// many ran. Never edit an entry that shipped: append a new one.
pub(crate) const SQLITE_MIGRATIONS: &[&str] = &[r#"
CREATE TABLE idempotency_records (
    scope        BLOB    NOT NULL,
    key          BLOB    NOT NULL,
    fingerprint  BLOB    NOT NULL,
    state        TEXT    NOT NULL CHECK (state IN ('in_flight', 'completed', 'unstored')),
    token        BLOB,
    locked_until INTEGER NOT NULL,
    created_at   INTEGER NOT NULL,
    expires_at   INTEGER NOT NULL,
    status       INTEGER,
    headers      BLOB,
    body         BLOB,
    takeover     INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (scope, key)
) WITHOUT ROWID;
CREATE INDEX idempotency_records_expires_at ON idempotency_records (expires_at);
"#];

/// PostgreSQL's ordered schema migrations; `{schema}` is replaced by the
/// quoted schema name. Never edit an entry that shipped: append a new one.
pub const POSTGRES_MIGRATIONS: &[&str] = &[r#"
CREATE TABLE {schema}.idempotency_records (
    scope        bytea   NOT NULL,
    key          bytea   NOT NULL,
    fingerprint  bytea   NOT NULL,
    state        text    NOT NULL CHECK (state IN ('in_flight', 'completed', 'unstored')),
    token        bytea,
    locked_until bigint  NOT NULL,
    created_at   bigint  NOT NULL,
    expires_at   bigint  NOT NULL,
    status       int,
    headers      bytea,
    body         bytea,
    -- Set by the claim's ON CONFLICT branch from the old row: RETURNING only
    -- sees new values (before PostgreSQL 18), so this carries "was a takeover".
    takeover     boolean NOT NULL DEFAULT false,
    PRIMARY KEY (scope, key)
);
CREATE INDEX idempotency_records_expires_at ON {schema}.idempotency_records (expires_at);
"#];

// === the record rules, as predicates ===

/// [`super::is_claimable`] in SQL, for the claim's `ON CONFLICT` branch:
/// `r` is the row already there, `EXCLUDED` the claim and `$6` its `now`.
pub(crate) const CLAIMABLE: &str = "(r.state <> 'in_flight' AND r.expires_at <= $6) \
     OR (r.state = 'in_flight' AND r.locked_until <= $6 \
         AND (r.fingerprint = EXCLUDED.fingerprint OR r.expires_at <= $6))";

/// [`super::is_sweepable`] in SQL; `$1` is `now`.
pub(crate) const SWEEPABLE: &str =
    "expires_at <= $1 AND NOT (state = 'in_flight' AND locked_until > $1)";

/// The fence of renew, complete and release: the token (`$3`) still owns
/// the record and it is in flight.
pub(crate) const OWNED: &str = "scope = $1 AND key = $2 AND token = $3 AND state = 'in_flight'";

/// One record by its key.
const BY_KEY: &str = "scope = $1 AND key = $2";

// === statements ===

/// Every statement a SQL backend runs, in its dialect, for its table.
pub(crate) struct Statements {
    /// Binds scope, key, fingerprint, token, locked_until, now, expires_at;
    /// returns `takeover` when it claimed, no row when a live record is there.
    pub claim: String,
    /// Binds scope, key; returns the columns of [`super::codec::RecordRow`].
    pub select: String,
    /// Binds scope, key, token, locked_until.
    pub renew: String,
    /// Binds scope, key, token, state, status, headers, body, expires_at.
    pub complete: String,
    /// Binds scope, key, token.
    pub release: String,
    /// Binds scope, key.
    pub delete: String,
    /// Binds now, batch: deletes up to `batch` sweepable records, oldest first.
    pub sweep: String,
}

impl Statements {
    /// `table` is the table's name as written in a statement.
    pub(crate) fn new(dialect: Dialect, table: &str) -> Self {
        let sweep = match dialect {
            // No row locks in SQLite: the write transaction serializes sweeps.
            Dialect::Sqlite => format!(
                "DELETE FROM {table} WHERE (scope, key) IN ( \
                   SELECT scope, key FROM {table} \
                   WHERE {SWEEPABLE} \
                   ORDER BY expires_at LIMIT $2)"
            ),
            // Rows a claim is writing right now are skipped, not waited for.
            Dialect::Postgres => format!(
                "DELETE FROM {table} WHERE ctid = ANY(ARRAY( \
                   SELECT ctid FROM {table} \
                   WHERE {SWEEPABLE} \
                   ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED))"
            ),
        };
        let statements = Self {
            claim: format!(
                "INSERT INTO {table} AS r \
                   (scope, key, fingerprint, state, token, locked_until, created_at, expires_at, takeover) \
                 VALUES ($1, $2, $3, 'in_flight', $4, $5, $6, $7, FALSE) \
                 ON CONFLICT (scope, key) DO UPDATE SET \
                   fingerprint = EXCLUDED.fingerprint, state = 'in_flight', token = EXCLUDED.token, \
                   locked_until = EXCLUDED.locked_until, created_at = EXCLUDED.created_at, \
                   expires_at = EXCLUDED.expires_at, status = NULL, headers = NULL, body = NULL, \
                   takeover = (r.state = 'in_flight') \
                 WHERE {CLAIMABLE} \
                 RETURNING takeover"
            ),
            select: format!(
                "SELECT fingerprint, state, locked_until, created_at, expires_at, status, headers, body \
                 FROM {table} WHERE {BY_KEY}"
            ),
            renew: format!("UPDATE {table} SET locked_until = $4 WHERE {OWNED}"),
            complete: format!(
                "UPDATE {table} SET state = $4, status = $5, headers = $6, body = $7, \
                 token = NULL, locked_until = 0, expires_at = $8 WHERE {OWNED}"
            ),
            release: format!("DELETE FROM {table} WHERE {OWNED}"),
            delete: format!("DELETE FROM {table} WHERE {BY_KEY}"),
            sweep,
        };
        match dialect {
            Dialect::Postgres => statements,
            // `$` appears in these texts only as a placeholder.
            Dialect::Sqlite => statements.map(|sql| sql.replace('$', "?")),
        }
    }

    fn map(self, f: impl Fn(String) -> String) -> Self {
        Self {
            claim: f(self.claim),
            select: f(self.select),
            renew: f(self.renew),
            complete: f(self.complete),
            release: f(self.release),
            delete: f(self.delete),
            sweep: f(self.sweep),
        }
    }
}

// === bindings ===

/// A record's key as bound to `$1` (scope) and `$2` (key).
pub(crate) struct KeyParams<'a> {
    pub scope: &'a [u8],
    pub key: &'a [u8],
}

impl<'a> KeyParams<'a> {
    pub(crate) fn new(key: &'a RecordKey) -> Self {
        Self {
            scope: &key.scope.0[..],
            key: &key.key[..],
        }
    }
}

/// A record's key and its holder's token, as bound by [`OWNED`]
/// (`$1`, `$2`, `$3`).
pub(crate) struct OwnerParams<'a> {
    pub scope: &'a [u8],
    pub key: &'a [u8],
    pub token: &'a [u8],
}

impl<'a> OwnerParams<'a> {
    pub(crate) fn new(key: &'a RecordKey, token: &'a LeaseToken) -> Self {
        let KeyParams { scope, key } = KeyParams::new(key);
        Self {
            scope,
            key,
            token: &token.0[..],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    /// Pins the migrations that shipped: a database that ran one must
    /// find the same schema on the next start. Append, never edit.
    #[test]
    fn shipped_migrations_are_unchanged() {
        let digests = |migrations: &[&str]| -> Vec<String> {
            migrations
                .iter()
                .map(|sql| hex::encode(Sha256::digest(sql.as_bytes())))
                .collect()
        };
        assert_eq!(
            digests(SQLITE_MIGRATIONS),
            ["5bc37de04ce31204af736792c70bab12dcfe0acf51ccfdcd04ae56fa18855f9a"]
        );
        assert_eq!(
            digests(POSTGRES_MIGRATIONS),
            ["3d5ebb9cdc43db1e853dc49350dfb03b2922485086ab12c3b6d43663ba57c775"]
        );
    }

    #[test]
    fn sqlite_statements_use_numbered_question_marks() {
        let sqlite = Statements::new(Dialect::Sqlite, "idempotency_records");
        let postgres = Statements::new(Dialect::Postgres, "\"s\".idempotency_records");
        assert!(!sqlite.claim.contains('$'));
        assert!(sqlite.claim.contains("r.locked_until <= ?6"));
        assert!(postgres.claim.contains("r.locked_until <= $6"));
        assert!(sqlite.sweep.contains("(scope, key) IN"));
        assert!(postgres.sweep.contains("FOR UPDATE SKIP LOCKED"));
        assert_eq!(
            sqlite.release,
            "DELETE FROM idempotency_records \
             WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in_flight'"
        );
    }
}
