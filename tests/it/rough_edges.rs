//! Regression tests for the rough edges a newcomer hit (issue 12), each
//! named after what it pins, on the real binary.

use crate::support::{run_on_config_text, Route, ServeProcess, TestConfig, Upstream, ORDERS};
use std::time::Duration;

const MINIMAL: &str = "[server]\nupstream = \"http://127.0.0.1:3000\"\n";

/// `check-config` on `text`: its exit code and stderr (file path replaced by `FILE`).
async fn check(text: &str) -> (i32, String) {
    let (run, path) = run_on_config_text(&["check-config"], text, &[]).await;
    (run.code, run.stderr.replace(&path, "FILE"))
}

/// Pins: `[log] level = "verbose"` passed check-config (EnvFilter reads a
/// bare word as a target), and then every log line was silenced.
#[tokio::test]
async fn an_unknown_log_level_is_a_config_error_naming_its_line() {
    let (code, err) = check(&format!("{MINIMAL}[log]\nlevel = \"verbose\"\n")).await;
    assert_eq!(code, 64, "{err}");
    assert!(
        err.contains("FILE: line 4: log.level \"verbose\": \"verbose\" is not a level"),
        "{err}"
    );
}

/// Pins: `methods = ["PSOT"]` was accepted and the route never matched,
/// so its traffic passed unprotected.
#[tokio::test]
async fn a_misspelled_method_is_refused_unless_allowed() {
    let route = "[[route]]\nmethods = [\"PSOT\"]\npath = \"/orders\"\n";
    let (code, err) = check(&format!("{MINIMAL}{route}")).await;
    assert_eq!(code, 64, "{err}");
    assert!(
        err.contains("FILE: line 3: route #1: method \"PSOT\""),
        "{err}"
    );
    let (code, err) = check(&format!("{MINIMAL}{route}allow_custom_methods = true\n")).await;
    assert_eq!(code, 0, "{err}");
}

/// Pins: whole-file checks named the file and field but not the line.
#[tokio::test]
async fn whole_file_checks_name_the_line() {
    let cases = [
        (
            "[server]\nlisten = \"127.0.0.1:1\"\n",
            "FILE: line 1: server.upstream is required",
        ),
        (
            &format!("{MINIMAL}[store]\nbackend = \"sqlite\"\nschema = \"x\"\n") as &str,
            "FILE: line 5: store.schema only applies to backend = \"postgres\"",
        ),
        (
            &format!("{MINIMAL}[redis]\nurl = \"redis://127.0.0.1\"\n"),
            "FILE: line 3: [redis] is a fast path",
        ),
    ];
    for (text, want) in cases {
        let (code, err) = check(text).await;
        assert_eq!(code, 64, "{err}");
        assert!(err.contains(want), "{want}\nnot in\n{err}");
    }
}

/// Pins: SIGHUP killed the process without draining (the default action);
/// now it reloads, and text logs written to a file carry no colour codes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_instead_of_killing_and_file_logs_have_no_colours() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemgate.toml");
    let (listen, admin) = (crate::support::free_port(), crate::support::free_port());
    // A ttl shorter than upstream_timeout + lease: a start-up warning to log.
    TestConfig::new(up.addr)
        .listen(listen, admin)
        .set("store.backend", "memory")
        .route(Route::post(ORDERS).set("ttl", "31s"))
        .write(&path);
    let mut gate = ServeProcess::start(&path, listen, admin, &[]).await;
    gate.hangup();
    crate::support::wait_for("the reload to be counted", || async {
        let text = gate.admin_get("/metrics").send().await.text();
        (crate::support::metric_value(&text, "idemgate_config_reloads_total{result=\"ok\"}") == 1)
            .then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        gate.post(ORDERS).key("k").body("{}").send().await.status(),
        201
    );
    let log = gate.log();
    assert!(log.contains("ttl (31s) is shorter"), "{log}");
    assert!(!log.contains('\u{1b}'), "colour codes in a file: {log:?}");
    gate.terminate();
    assert_eq!(gate.exited().await, Some(0), "{}", gate.log());
}
