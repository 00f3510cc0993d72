//! `synchronous_commit`: every session of this store commits at least
//! `on` (a weaker server, database, role or URL default is raised for
//! idemgate's own sessions, a stronger one kept), and what the server had
//! is told once at start-up and by `check-config --connect`; likewise
//! whether the primary has a synchronous standby ([`ReplicationReport`]),
//! which `store.require_synchronous_replication` demands before a claim.

/// `synchronous_commit` values that acknowledge a commit before it is
/// durable: `off` before the WAL is flushed (a server crash loses it),
/// `local` before a synchronous standby has it (a failover loses it),
/// `remote_write` once a synchronous standby has written it but before it
/// flushed it (a crash of the standby's machine, then a failover to it,
/// loses it). PostgreSQL ranks all three below `on`.
const WEAK_COMMIT: [&str; 3] = ["off", "local", "remote_write"];
/// What idemgate raises them to.
const DURABLE_COMMIT: &str = "on";

/// The `synchronous_commit` a session whose value is `effective` must run
/// with: `on` for a weak value ([`WEAK_COMMIT`]); `None` keeps it (`on`,
/// `remote_apply`, and a value this version does not know: never
/// lowered). The statements that apply it ([`raise_commit_sql`])
/// test the same list on the server.
pub fn raised_commit(effective: &str) -> Option<&'static str> {
    WEAK_COMMIT.contains(&effective).then_some(DURABLE_COMMIT)
}

/// Raises the current session's (`transaction`: the current
/// transaction's) `synchronous_commit` to [`DURABLE_COMMIT`] when it is
/// weak, and does nothing otherwise: one statement, no round trip of its
/// own behind a pooler (it goes in the `BEGIN` batch).
pub(super) fn raise_commit_sql(transaction: bool) -> String {
    let weak = WEAK_COMMIT
        .iter()
        .map(|v| format!("'{v}'"))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "SELECT set_config('synchronous_commit', '{DURABLE_COMMIT}', {transaction}) \
         WHERE current_setting('synchronous_commit') IN ({weak})"
    )
}

/// The value the session started with (the server's, database's, role's
/// or the URL's `options`) and the one it runs with now.
pub(super) const COMMIT_REPORT: &str = "SELECT reset_val, current_setting('synchronous_commit') \
     FROM pg_settings WHERE name = 'synchronous_commit'";

/// `synchronous_commit` as a session of this store saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommitReport {
    /// What the session started with.
    pub server: String,
    /// What idemgate's statements commit with.
    pub session: String,
}

impl CommitReport {
    pub fn raised(&self) -> bool {
        self.server != self.session
    }

    /// One sentence for `check-config --connect`; `Err` when the session
    /// still runs weaker than `on` (it could not be raised).
    pub fn describe(&self) -> Result<String, String> {
        let Self { server, session } = self;
        if raised_commit(session).is_some() {
            return Err(format!(
                "postgres: synchronous_commit is {session} in idemgate's sessions and could not be raised to {DURABLE_COMMIT}: a claim could be acknowledged before it is durable on the server and its synchronous standby"
            ));
        }
        Ok(if self.raised() {
            format!(
                "synchronous_commit is {server} (the server's, database's, role's or store.url's); raised to {session} for idemgate's sessions, so a claim is on disk before the upstream is called"
            )
        } else {
            format!("synchronous_commit is {server}: kept")
        })
    }
}

/// The primary's standbys as `pg_stat_replication` lists them: how many
/// stream, how many of those are synchronous (`sync` or `quorum`), and how
/// many hide their state from this role (it lacks `pg_monitor`).
pub(super) const REPLICATION_REPORT: &str = "SELECT current_setting('synchronous_standby_names'), \
     count(*), \
     count(*) FILTER (WHERE sync_state IN ('sync', 'quorum')), \
     count(*) FILTER (WHERE sync_state IS NULL) \
     FROM pg_stat_replication";

/// Run on every new connection with `store.require_synchronous_replication`:
/// fails (SQLSTATE P0001, with this message) unless the server has a
/// synchronous standby, so that after a failover not one claim goes to a
/// primary without one before [`ReplicationReport`]'s periodic check sees it.
pub(super) const REQUIRE_SYNC_ON_CONNECT: &str = "DO $$ BEGIN \
     IF current_setting('synchronous_standby_names') = '' OR NOT EXISTS \
       (SELECT 1 FROM pg_stat_replication WHERE sync_state IN ('sync', 'quorum')) THEN \
       RAISE EXCEPTION 'store.require_synchronous_replication: this server has no synchronous standby (synchronous_standby_names, pg_stat_replication)'; \
     END IF; END $$";

/// Whether a commit acknowledged by the primary is also on a standby.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicationReport {
    /// `synchronous_standby_names`; empty: commits never wait for a standby.
    pub standby_names: String,
    pub streaming: i64,
    pub synchronous: i64,
    /// Standbys whose `sync_state` this role may not read.
    pub hidden: i64,
}

impl ReplicationReport {
    /// `Ok`: a failover to a synchronous standby keeps every acknowledged
    /// claim and answer; `Err` says why that is not known to hold.
    pub fn synchronous(&self) -> Result<String, String> {
        let Self {
            standby_names,
            streaming,
            synchronous,
            hidden,
        } = self;
        if *hidden > 0 {
            return Err(format!(
                "{hidden} standby(s) hide their sync_state from idemgate's role: grant it pg_monitor to see whether replication is synchronous"
            ));
        }
        if standby_names.is_empty() {
            return Err(format!(
                "no synchronous standby (synchronous_standby_names is empty; {streaming} asynchronous standby(s)): a claim or answer acknowledged just before a failover can be lost, and its retry runs again"
            ));
        }
        if *synchronous == 0 {
            return Err(format!(
                "synchronous_standby_names = '{standby_names}' but no synchronous standby is connected ({streaming} streaming): commits wait until one is"
            ));
        }
        Ok(format!(
            "{synchronous} synchronous standby(s) of {streaming} streaming (synchronous_standby_names = '{standby_names}'): an acknowledged claim or answer survives a failover to them"
        ))
    }

    /// One sentence, good or bad, for start-up and `check-config --connect`.
    pub fn describe(&self) -> String {
        match self.synchronous() {
            Ok(good) => format!("replication: {good}"),
            Err(bad) => format!("replication: {bad}"),
        }
    }
}

/// What `check-config --connect` learned from one connection.
#[derive(Clone, Debug)]
pub struct Probe {
    /// TLS (which version) or plaintext (why).
    pub transport: String,
    pub commit: CommitReport,
    pub replication: ReplicationReport,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synchronous_commit_is_raised_to_on_where_weaker_and_never_lowered() {
        for (effective, runs_with) in [
            ("off", Some("on")),
            ("local", Some("on")),
            // The standby wrote the WAL but did not flush it: below `on`.
            ("remote_write", Some("on")),
            ("on", None),
            ("remote_apply", None),
            // A value a newer server may add: kept rather than guessed at.
            ("remote_flush", None),
        ] {
            assert_eq!(raised_commit(effective), runs_with, "{effective}");
        }
        // The server applies the same list.
        for sql in [raise_commit_sql(false), raise_commit_sql(true)] {
            assert!(
                sql.ends_with("IN ('off', 'local', 'remote_write')"),
                "{sql}"
            );
        }
        assert!(raise_commit_sql(true).contains("'on', true)"));
        assert!(raise_commit_sql(false).contains("'on', false)"));
    }

    #[test]
    fn replication_is_synchronous_only_with_a_connected_synchronous_standby() {
        let report = |names: &str, streaming, synchronous, hidden| ReplicationReport {
            standby_names: names.into(),
            streaming,
            synchronous,
            hidden,
        };
        let cases = [
            (
                report("", 0, 0, 0),
                Err("synchronous_standby_names is empty"),
            ),
            (report("", 2, 0, 0), Err("2 asynchronous standby(s)")),
            (
                report("*", 0, 0, 0),
                Err("no synchronous standby is connected"),
            ),
            (report("*", 1, 0, 1), Err("grant it pg_monitor")),
            (
                report("ANY 1 (a, b)", 2, 2, 0),
                Ok("2 synchronous standby(s) of 2"),
            ),
            (report("*", 2, 1, 0), Ok("1 synchronous standby(s) of 2")),
        ];
        for (report, want) in cases {
            let got = report.synchronous();
            match (&got, want) {
                (Ok(s), Ok(w)) | (Err(s), Err(w)) => assert!(s.contains(w), "{s}"),
                _ => panic!("{report:?}: {got:?}, want {want:?}"),
            }
            assert!(report.describe().starts_with("replication: "));
        }
    }

    #[test]
    fn the_commit_report_says_what_the_server_has_and_what_idemgate_runs_with() {
        let report = |server: &str, session: &str| CommitReport {
            server: server.into(),
            session: session.into(),
        };
        let raised = report("off", "on").describe().unwrap();
        assert!(
            raised.starts_with("synchronous_commit is off (the server's")
                && raised.contains("raised to on"),
            "{raised}"
        );
        assert_eq!(
            report("remote_apply", "remote_apply").describe().unwrap(),
            "synchronous_commit is remote_apply: kept"
        );
        let stuck = report("local", "local").describe().unwrap_err();
        assert!(stuck.contains("could not be raised"), "{stuck}");
        let stuck = report("remote_write", "remote_write")
            .describe()
            .unwrap_err();
        assert!(stuck.contains("could not be raised to on"), "{stuck}");
        let raised = report("remote_write", "on").describe().unwrap();
        assert!(raised.contains("raised to on"), "{raised}");
    }
}
