//! `synchronous_commit`: every session of this store commits at least
//! `on` (a weaker server, database, role or URL default is raised for
//! idemgate's own sessions, a stronger one kept), and what the server had
//! is told once at start-up and by `check-config --connect`.

/// `synchronous_commit` values that acknowledge a commit before it is
/// durable: `off` before the WAL is flushed (a server crash loses it),
/// `local` before a synchronous standby has it (a failover loses it).
const WEAK_COMMIT: [&str; 2] = ["off", "local"];
/// What idemgate raises them to.
const DURABLE_COMMIT: &str = "on";

/// The `synchronous_commit` a session whose value is `effective` must run
/// with: `on` for a weak value ([`WEAK_COMMIT`]); `None` keeps it (`on`,
/// `remote_write`, `remote_apply`, and a value this version does not know:
/// never lowered). The statements that apply it ([`raise_commit_sql`])
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
                "postgres: synchronous_commit is {session} in idemgate's sessions and could not be raised to {DURABLE_COMMIT}: claims would not survive a server crash"
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

/// What `check-config --connect` learned from one connection.
#[derive(Clone, Debug)]
pub struct Probe {
    /// TLS (which version) or plaintext (why).
    pub transport: String,
    pub commit: CommitReport,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synchronous_commit_is_raised_to_on_where_weaker_and_never_lowered() {
        for (effective, runs_with) in [
            ("off", Some("on")),
            ("local", Some("on")),
            ("remote_write", None),
            ("on", None),
            ("remote_apply", None),
            // A value a newer server may add: kept rather than guessed at.
            ("remote_flush", None),
        ] {
            assert_eq!(raised_commit(effective), runs_with, "{effective}");
        }
        // The server applies the same list.
        for sql in [raise_commit_sql(false), raise_commit_sql(true)] {
            assert!(sql.ends_with("IN ('off', 'local')"), "{sql}");
        }
        assert!(raise_commit_sql(true).contains("'on', true)"));
        assert!(raise_commit_sql(false).contains("'on', false)"));
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
    }
}
