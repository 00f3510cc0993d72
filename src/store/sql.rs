//! The SQL that SQLite and PostgreSQL share, side by side: the table layout,
//! the record rules as predicates, and every statement's text.
//!
//! Statements are written once, in PostgreSQL's placeholder style (`$1`),
//! and [`Statements::new`] turns them into SQLite's (`?1`). The only other
//! differences are spelled out where they occur: the table name (schema
//! qualified in PostgreSQL), and the sweep's row locking (`FOR UPDATE SKIP
//! LOCKED` in PostgreSQL). Both select rows by primary key, never by
//! `ctid`, which distributed PostgreSQL-compatible engines lack. Column
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
pub(crate) const SQLITE_MIGRATIONS: &[&str] = &[
    r#"
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
"#,
    r#"
-- 2: the 'unknown' state (on_ambiguous = "keep"). SQLite cannot alter a
-- CHECK constraint, so the table is rebuilt with the same columns.
CREATE TABLE idempotency_records_v2 (
    scope        BLOB    NOT NULL,
    key          BLOB    NOT NULL,
    fingerprint  BLOB    NOT NULL,
    state        TEXT    NOT NULL CHECK (state IN ('in_flight', 'completed', 'unstored', 'unknown')),
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
INSERT INTO idempotency_records_v2 SELECT * FROM idempotency_records;
DROP TABLE idempotency_records;
ALTER TABLE idempotency_records_v2 RENAME TO idempotency_records;
CREATE INDEX idempotency_records_expires_at ON idempotency_records (expires_at);
"#,
    r#"
-- 3: an operator's resolution of an outcome-unknown key as applied
-- (`idemgate keys resolve`): when, and why. NULL on every other record.
ALTER TABLE idempotency_records ADD COLUMN resolved_at INTEGER;
ALTER TABLE idempotency_records ADD COLUMN resolve_reason TEXT;
"#,
    r#"
-- 4: what the claiming request was (its method, and its path without the
-- query), for the 422 a reused key gets. NULL on records claimed before.
ALTER TABLE idempotency_records ADD COLUMN first_method TEXT;
ALTER TABLE idempotency_records ADD COLUMN first_path TEXT;
"#,
];

/// PostgreSQL's ordered schema migrations; `{schema}` is replaced by the
/// quoted schema name. Never edit an entry that shipped: append a new one.
pub const POSTGRES_MIGRATIONS: &[&str] = &[
    r#"
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
"#,
    r#"
-- 2: the 'unknown' state (on_ambiguous = "keep").
ALTER TABLE {schema}.idempotency_records
    DROP CONSTRAINT idempotency_records_state_check,
    ADD CONSTRAINT idempotency_records_state_check
        CHECK (state IN ('in_flight', 'completed', 'unstored', 'unknown'));
"#,
    r#"
-- 3: an operator's resolution of an outcome-unknown key as applied
-- (`idemgate keys resolve`): when, and why. NULL on every other record.
ALTER TABLE {schema}.idempotency_records
    ADD COLUMN resolved_at bigint,
    ADD COLUMN resolve_reason text;
"#,
    r#"
-- 4: what the claiming request was (its method, and its path without the
-- query), for the 422 a reused key gets. NULL on records claimed before.
ALTER TABLE {schema}.idempotency_records
    ADD COLUMN first_method text,
    ADD COLUMN first_path text;
"#,
];

// === time ===

/// "now" at parameter `$n`, in milliseconds since the epoch: for SQLite the
/// bound value is the caller's clock; for PostgreSQL it is the server's
/// clock at the start of the statement plus the bound value, an offset that
/// is zero except in tests. See [`super::Span`] for why the shared store
/// judges time itself.
fn now_at(dialect: Dialect, n: u8) -> String {
    match dialect {
        Dialect::Sqlite => format!("${n}"),
        Dialect::Postgres => {
            format!("(CAST(EXTRACT(EPOCH FROM statement_timestamp()) * 1000 AS bigint) + ${n})")
        }
    }
}

// === the record rules, as predicates ===

/// [`super::is_claimable`] in SQL: `row` is the record already there,
/// `fingerprint` the claim's and `now` the claim's "now".
fn claimable(row: &str, fingerprint: &str, now: &str) -> String {
    format!(
        "({row}.state <> 'in_flight' AND {row}.expires_at <= {now}) \
         OR ({row}.state = 'in_flight' AND {row}.locked_until <= {now} \
             AND ({row}.fingerprint = {fingerprint} OR {row}.expires_at <= {now}))"
    )
}

/// A record `row` that a claim for `fingerprint` cannot take: NOT
/// [`claimable`].
fn claim_live(row: &str, fingerprint: &str, now: &str) -> String {
    format!("NOT ({})", claimable(row, fingerprint, now))
}

/// [`super::is_sweepable`] in SQL.
fn sweepable(now: &str) -> String {
    format!("expires_at <= {now} AND NOT (state = 'in_flight' AND locked_until > {now})")
}

/// The fence of renew, complete and release: the token (`$3`) still owns
/// the record and it is in flight.
pub(crate) const OWNED: &str = "scope = $1 AND key = $2 AND token = $3 AND state = 'in_flight'";

/// One record by its key.
const BY_KEY: &str = "scope = $1 AND key = $2";

/// The one record an operator's resolve may change: still outcome unknown,
/// and live at `now` (an expired record is gone for every claim already:
/// settling it would report a verdict no request will ever see).
fn unknown_live(now: &str) -> String {
    format!("scope = $1 AND key = $2 AND state = 'unknown' AND expires_at > {now}")
}

/// The record columns, in [`super::codec::RecordRow`]'s order.
const COLUMNS: &str = "fingerprint, state, locked_until, created_at, expires_at, status, \
     headers, body, first_method, first_path";

/// How many [`COLUMNS`] there are: a statement's columns after them start here.
pub(crate) const RECORD_COLUMNS: usize = 10;

/// The claim's write into `table`: a new in-flight record from `rows`, or
/// one taking over the record there where `claimable` holds.
fn upsert(table: &str, rows: &str, claimable: &str, returning: &str) -> String {
    format!(
        "INSERT INTO {table} AS r \
           (scope, key, fingerprint, state, token, locked_until, created_at, expires_at, takeover, \
            first_method, first_path) \
         {rows} \
         ON CONFLICT (scope, key) DO UPDATE SET \
           fingerprint = EXCLUDED.fingerprint, state = 'in_flight', token = EXCLUDED.token, \
           locked_until = EXCLUDED.locked_until, created_at = EXCLUDED.created_at, \
           expires_at = EXCLUDED.expires_at, status = NULL, headers = NULL, body = NULL, \
           first_method = EXCLUDED.first_method, first_path = EXCLUDED.first_path, \
           resolved_at = NULL, resolve_reason = NULL, takeover = (r.state = 'in_flight') \
         WHERE {claimable} \
         RETURNING {returning}"
    )
}

// === statements ===

/// Every statement a SQL backend runs, in its dialect, for its table.
pub(crate) struct Statements {
    /// Binds scope, key, fingerprint, token, lease_ms, now, ttl_ms,
    /// first_method, first_path; returns `takeover` when it claimed, no
    /// row when a live record is there.
    pub claim: String,
    /// PostgreSQL: the claim that writes nothing when a live record is
    /// there (a replay costs no row lock, no WAL flush): binds as `claim`;
    /// returns one row: `takeover` (NULL unless it claimed), the "now" it
    /// judged by, and the record it found (all NULL when there was none).
    /// SQLite has no data-modifying CTEs; it runs `claim` in a transaction.
    pub claim_or_read: String,
    /// PostgreSQL: `claim_or_read` for many keys at once (group commit):
    /// binds arrays of scope, key, fingerprint, token, lease_ms, ttl_ms, the
    /// offset, then arrays of first_method, first_path; returns per input row (in order): its ordinal, `takeover`
    /// (NULL unless claimed), "now", and the record found. The keys must be
    /// distinct. SQLite: empty (its batches are one transaction).
    pub claim_many: String,
    /// PostgreSQL: `complete` for many holders at once: binds arrays of
    /// scope, key, token, state, status, headers, body, keep_ms, and the
    /// offset; returns the (scope, key) of every row whose fence held.
    pub complete_many: String,
    /// Binds scope, key; returns the columns of [`super::codec::RecordRow`].
    pub select: String,
    /// Binds scope, key, now; returns [`Statements::select`]'s columns and
    /// the "now" they were read at (column [`RECORD_COLUMNS`]), to shift
    /// them into the caller's frame.
    pub select_at: String,
    /// Binds scope, key, token, now, lease_ms.
    pub renew: String,
    /// Binds scope, key, token, state, status, headers, body, now, keep_ms.
    pub complete: String,
    /// Binds scope, key, token.
    pub release: String,
    /// Binds scope, key.
    pub delete: String,
    /// Binds scope, key, status, now, reason: a live outcome-unknown
    /// record becomes unstored, keeping when and why.
    pub resolve_applied: String,
    /// Binds scope, key, now: deletes the record if it is outcome unknown
    /// and live.
    pub resolve_not_applied: String,
    /// Binds scope, key; returns `resolved_at`, `resolve_reason` of a
    /// record resolved as applied (no row for any other).
    pub resolution: String,
    /// Binds now, batch: deletes up to `batch` sweepable records, oldest first.
    pub sweep: String,
    /// Binds the scope and key to start after (both empty to start at the
    /// first: an empty byte string sorts before every digest), now, limit;
    /// returns scope, key, then [`Statements::select`]'s columns, of live
    /// completed records in primary-key order.
    pub scan_completed: String,
    /// Binds scope, key, old status, old headers, old body, new status,
    /// new headers, new body: the compare-and-set of a stored response.
    pub rewrite_response: String,
}

impl Statements {
    /// `table` is the table's name as written in a statement.
    pub(crate) fn new(dialect: Dialect, table: &str) -> Self {
        let now = |n| now_at(dialect, n);
        let (sweep_lock, greatest) = match dialect {
            // No row locks in SQLite: the write transaction serializes sweeps.
            Dialect::Sqlite => ("", "MAX"),
            // Rows a claim is writing right now are skipped, not waited for.
            // By primary key, not `ctid`: CockroachDB and YugabyteDB have
            // no `ctid`, and the key is one index probe per row either way.
            Dialect::Postgres => (" FOR UPDATE SKIP LOCKED", "GREATEST"),
        };
        let postgres_only = |sql: String| match dialect {
            Dialect::Sqlite => String::new(),
            Dialect::Postgres => sql,
        };
        // `$` appears in these texts only as a placeholder.
        let placeholders = |sql: String| match dialect {
            Dialect::Sqlite => sql.replace('$', "?"),
            Dialect::Postgres => sql,
        };
        let claim_now = now(6);
        let live = claimable("cur", "$3::bytea", &claim_now);
        let claimable_here = claimable("r", "EXCLUDED.fingerprint", &claim_now);
        let many_now = now(7);
        let live_many = claim_live("c", "i.fingerprint", &many_now);
        let claimable_many = claimable("r", "EXCLUDED.fingerprint", &many_now);
        Self {
            claim: placeholders(upsert(
                table,
                &format!(
                    "VALUES ($1, $2, $3, 'in_flight', $4, {claim_now} + $5, {claim_now}, {claim_now} + $7, FALSE, $8, $9)"
                ),
                &claimable_here,
                "takeover",
            )),
            claim_or_read: postgres_only(format!(
                "WITH cur AS (SELECT {COLUMNS} FROM {table} WHERE {BY_KEY}), \
                 ins AS ( {}) \
                 SELECT (SELECT takeover FROM ins), {claim_now}, cur.* \
                 FROM (SELECT 1) AS one LEFT JOIN cur ON TRUE",
                upsert(
                    table,
                    &format!(
                        "SELECT $1::bytea, $2::bytea, $3::bytea, 'in_flight', $4::bytea, \
                         {claim_now} + $5::bigint, {claim_now}, {claim_now} + $7::bigint, FALSE, \
                         $8::text, $9::text \
                         WHERE NOT EXISTS (SELECT 1 FROM cur WHERE NOT ({live}))"
                    ),
                    &claimable_here,
                    "takeover",
                )
            )),
            claim_many: postgres_only(format!(
                "WITH i AS ( \
                   SELECT * FROM unnest($1::bytea[], $2::bytea[], $3::bytea[], $4::bytea[], \
                                        $5::bigint[], $6::bigint[], $8::text[], $9::text[]) \
                     WITH ORDINALITY \
                     AS i(scope, key, fingerprint, token, lease_ms, ttl_ms, first_method, \
                          first_path, n)), \
                 c AS (SELECT t.*, i.n FROM {table} t JOIN i ON t.scope = i.scope AND t.key = i.key), \
                 ins AS ( {}) \
                 SELECT i.n, ins.takeover, {many_now}, \
                        c.fingerprint, c.state, c.locked_until, c.created_at, c.expires_at, \
                        c.status, c.headers, c.body, c.first_method, c.first_path \
                 FROM i LEFT JOIN ins ON ins.scope = i.scope AND ins.key = i.key \
                        LEFT JOIN c ON c.n = i.n \
                 ORDER BY i.n",
                upsert(
                    table,
                    &format!(
                        "SELECT i.scope, i.key, i.fingerprint, 'in_flight', i.token, \
                         {many_now} + i.lease_ms, {many_now}, {many_now} + i.ttl_ms, FALSE, \
                         i.first_method, i.first_path \
                         FROM i WHERE NOT EXISTS (SELECT 1 FROM c WHERE c.n = i.n AND {live_many})"
                    ),
                    &claimable_many,
                    "r.scope, r.key, r.takeover",
                )
            )),
            complete_many: postgres_only(format!(
                "UPDATE {table} AS t SET state = v.state, status = v.status, headers = v.headers, \
                   body = v.body, token = NULL, locked_until = 0, \
                   expires_at = GREATEST(t.expires_at, {} + v.keep_ms) \
                 FROM unnest($1::bytea[], $2::bytea[], $3::bytea[], $4::text[], $5::int[], \
                             $6::bytea[], $7::bytea[], $8::bigint[]) \
                   AS v(scope, key, token, state, status, headers, body, keep_ms) \
                 WHERE t.scope = v.scope AND t.key = v.key AND t.token = v.token \
                   AND t.state = 'in_flight' \
                 RETURNING t.scope, t.key",
                now(9)
            )),
            select: placeholders(format!("SELECT {COLUMNS} FROM {table} WHERE {BY_KEY}")),
            select_at: placeholders(format!(
                "SELECT {COLUMNS}, {} FROM {table} WHERE {BY_KEY}",
                now(3)
            )),
            renew: placeholders(format!(
                "UPDATE {table} SET locked_until = {} + $5 WHERE {OWNED}",
                now(4)
            )),
            complete: placeholders(format!(
                "UPDATE {table} SET state = $4, status = $5, headers = $6, body = $7, \
                 token = NULL, locked_until = 0, expires_at = {greatest}(expires_at, {} + $9) \
                 WHERE {OWNED}",
                now(8)
            )),
            release: placeholders(format!("DELETE FROM {table} WHERE {OWNED}")),
            delete: placeholders(format!("DELETE FROM {table} WHERE {BY_KEY}")),
            resolve_applied: placeholders(format!(
                "UPDATE {table} SET state = 'unstored', status = $3, resolved_at = {}, \
                 resolve_reason = $5 WHERE {}",
                now(4),
                unknown_live(&now(4))
            )),
            resolve_not_applied: placeholders(format!(
                "DELETE FROM {table} WHERE {}",
                unknown_live(&now(3))
            )),
            resolution: placeholders(format!(
                "SELECT resolved_at, resolve_reason FROM {table} \
                 WHERE {BY_KEY} AND state = 'unstored' AND resolved_at IS NOT NULL"
            )),
            sweep: placeholders(format!(
                "DELETE FROM {table} WHERE (scope, key) IN ( \
                   SELECT scope, key FROM {table} \
                   WHERE {} \
                   ORDER BY expires_at LIMIT $2{sweep_lock})",
                sweepable(&now(1))
            )),
            // Row-value comparison walks the primary key index from the
            // cursor in both engines.
            scan_completed: placeholders(format!(
                "SELECT scope, key, {COLUMNS} FROM {table} \
                 WHERE (scope, key) > ($1, $2) AND state = 'completed' AND expires_at > {} \
                 ORDER BY scope, key LIMIT $4",
                now(3)
            )),
            rewrite_response: placeholders(format!(
                "UPDATE {table} SET status = $6, headers = $7, body = $8 \
                 WHERE {BY_KEY} AND state = 'completed' AND status = $3 \
                   AND headers = $4 AND body = $5"
            )),
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
            [
                "5bc37de04ce31204af736792c70bab12dcfe0acf51ccfdcd04ae56fa18855f9a",
                "bac05e27f3f9bd9ce056711d9a13913ca572e14140432b39022ceea6487bf133",
                "bef07a51036175b142813044310d1885097530d4467f0cf8cd6975f6dc74ca69",
                "ee35ac8fa7466f4a12c2c329c4c7ac0db4a7d8fd8279e125d4c9936c35f7c3a8"
            ]
        );
        assert_eq!(
            digests(POSTGRES_MIGRATIONS),
            [
                "3d5ebb9cdc43db1e853dc49350dfb03b2922485086ab12c3b6d43663ba57c775",
                "a58c49c091676b6b3d18cde1fbc145ce179a4f820f5e7637eca3d52ee49c9a07",
                "a993d5a9813793fc91ed0d30afba8f2c7406bfb59788f8bdb5020b5a34a7b21b",
                "e8af560b341a10e3de201c7daf8ac37e9accb4ffadfb3ea9e98f202ed9865a18"
            ]
        );
    }

    #[test]
    fn record_columns_counts_the_columns() {
        assert_eq!(COLUMNS.split(',').count(), RECORD_COLUMNS);
    }

    #[test]
    fn sqlite_statements_use_numbered_question_marks() {
        let sqlite = Statements::new(Dialect::Sqlite, "idempotency_records");
        let postgres = Statements::new(Dialect::Postgres, "\"s\".idempotency_records");
        assert!(!sqlite.claim.contains('$'));
        assert!(sqlite.claim.contains("r.locked_until <= ?6"));
        // PostgreSQL judges time by its own clock; `$6` is only an offset.
        assert!(postgres
            .claim
            .contains("r.locked_until <= (CAST(EXTRACT(EPOCH FROM statement_timestamp())"));
        assert!(postgres.complete.contains("GREATEST(expires_at"));
        assert!(sqlite.complete.contains("MAX(expires_at, ?8 + ?9)"));
        assert!(sqlite.sweep.contains("(scope, key) IN"));
        assert!(postgres.sweep.contains("FOR UPDATE SKIP LOCKED"));
        // Distributed engines (CockroachDB, YugabyteDB) have no ctid.
        assert!(!postgres.sweep.contains("ctid"));
        assert_eq!(
            sqlite.release,
            "DELETE FROM idempotency_records \
             WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in_flight'"
        );
    }
}
