//! The correctness traps in configuration of issue 22, on the real binary:
//! routes that shadow each other, Kubernetes service-link variables, an
//! upstream port out of range, output to a closed pipe, and `keys` commands
//! that cannot be right.

use crate::support::run_on_config_text;

const MINIMAL: &str = "[server]\nupstream = \"http://127.0.0.1:3000\"\n";

fn route(methods: &str, path: &str, rest: &str) -> String {
    format!("[[route]]\nmethods = {methods}\npath = \"{path}\"\n{rest}")
}

/// Pins: a prefix route `/payments/*` before `/payments` passed with "ok",
/// and keyed requests were protected under the prefix route's scope and
/// `on_ambiguous`, never the exact route's.
#[tokio::test]
async fn a_route_an_earlier_one_always_takes_is_a_config_error_naming_both() {
    let text = format!(
        "{MINIMAL}{}{}",
        route(r#"["POST"]"#, "/payments/*", "require_key = false\n"),
        route(
            r#"["POST"]"#,
            "/payments",
            "scope_headers = [\"Authorization\", \"X-Tenant\"]\non_ambiguous = \"keep\"\n"
        ),
    );
    let (run, path) = run_on_config_text(&["check-config"], &text, &[]).await;
    assert_eq!(run.code, 64, "{run:?}");
    assert!(
        run.stderr.contains(&format!(
            "{path}: line 9: route #2 POST /payments: never matches: route #1 (POST /payments/*, upstream default) takes every request it would"
        )),
        "{}",
        run.stderr
    );
    // The intended order passes, silently.
    let text = format!(
        "{MINIMAL}{}{}",
        route(r#"["POST"]"#, "/payments", "on_ambiguous = \"keep\"\n"),
        route(r#"["POST"]"#, "/payments/*", "require_key = false\n"),
    );
    let (run, _) = run_on_config_text(&["check-config"], &text, &[]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(!run.stdout.contains("shadowed_by"), "{}", run.stdout);
    assert!(!run.stdout.contains("listed before it"), "{}", run.stdout);
}

/// A general route before a specific one with more methods takes some of
/// its requests: a warning that says which go where, and check-config
/// prints each route's upstream and what shadows it.
#[tokio::test]
async fn a_partial_overlap_is_a_warning_saying_which_requests_go_where() {
    let text = format!(
        "{MINIMAL}[upstreams.billing]\nurl = \"http://127.0.0.1:3001\"\n{}{}",
        route(r#"["POST"]"#, "/payments/*", ""),
        route(
            r#"["POST", "PUT"]"#,
            "/payments",
            "upstream = \"billing\"\n"
        ),
    );
    let (run, _) = run_on_config_text(&["check-config"], &text, &[]).await;
    assert_eq!(run.code, 0, "{run:?}");
    let line = |prefix: &str| {
        run.stdout
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} line in {}", run.stdout))
            .to_string()
    };
    let first = line("  #1 ");
    assert!(first.ends_with(" upstream=default"), "{first}");
    let second = line("  #2 ");
    assert!(
        second.ends_with(" upstream=billing shadowed_by=#1"),
        "{second}"
    );
    let warning = line("warning: route #2");
    assert!(
        warning.contains("its POST requests go to route #1 (POST /payments/*, upstream default)")
            && warning.contains("only PUT reach it"),
        "{warning}"
    );
}

/// Pins: a Service named `idemgate-admin` in the namespace made Kubernetes
/// inject `IDEMGATE_ADMIN_PORT=tcp://...`, which the environment overlay
/// read as key `port` of `[admin]`: the pod never started.
#[tokio::test]
async fn kubernetes_service_link_variables_are_not_read_as_settings() {
    let links = [
        ("IDEMGATE_ADMIN_SERVICE_HOST", "10.0.0.1"),
        ("IDEMGATE_ADMIN_SERVICE_PORT", "9090"),
        ("IDEMGATE_ADMIN_SERVICE_PORT_METRICS", "9090"),
        ("IDEMGATE_ADMIN_PORT", "tcp://10.0.0.1:9090"),
        ("IDEMGATE_ADMIN_PORT_9090_TCP", "tcp://10.0.0.1:9090"),
        ("IDEMGATE_ADMIN_PORT_9090_TCP_PROTO", "tcp"),
        ("IDEMGATE_ADMIN_PORT_9090_TCP_PORT", "9090"),
        ("IDEMGATE_ADMIN_PORT_9090_TCP_ADDR", "10.0.0.1"),
        ("IDEMGATE_REDIS_PORT", "tcp://10.0.0.2:6379"),
        ("IDEMGATE_STORE_SERVICE_HOST", "10.0.0.3"),
    ];
    let text = format!("{MINIMAL}[admin]\nlisten = \"127.0.0.1:9901\"\n");
    let mut env = links.to_vec();
    env.push(("IDEMGATE_SERVER_UPSTREAM_TIMEOUT", "7s"));
    let (run, _) = run_on_config_text(&["check-config"], &text, &env).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.contains("timeout 7s"), "{}", run.stdout);
    // A genuinely unknown IDEMGATE_ variable still fails, as does a link's
    // name with a value of another form.
    for bad in [
        ("IDEMGATE_ADMIN_BOGUS", "1"),
        ("IDEMGATE_ADMIN_PORT", "9090"),
    ] {
        let mut env = links.to_vec();
        env.retain(|(k, _)| *k != bad.0);
        env.push(bad);
        let (run, _) = run_on_config_text(&["check-config"], &text, &env).await;
        assert_eq!(run.code, 64, "{bad:?}: {run:?}");
        assert!(run.stderr.contains(bad.0), "{}", run.stderr);
    }
}

/// `idemgate <args>` with its stdout a pipe whose reader is gone before it
/// writes (as `| head -1` leaves it): its exit code and stderr.
fn run_into_closed_pipe(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let mut cmd = crate::support::process::command();
    cmd.args(args)
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().expect("spawn idemgate");
    // Closed at once: the binary reads and checks its config first.
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait for idemgate");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (
        out.status.code().expect("an exit code, not a signal"),
        stderr,
    )
}

/// Pins: `idemgate check-config | head -1` panicked on the broken pipe
/// (exit 101); every command that prints ends with its own status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_whose_reader_left_exit_with_their_own_status_without_a_panic() {
    use crate::support::services::{database_url, drop_schema, require_postgres, unique_schema};
    let dir = tempfile::TempDir::new().expect("tempdir");
    let sqlite = dir.path().join("sqlite.toml");
    std::fs::write(
        &sqlite,
        format!(
            "{MINIMAL}[store]\nbackend = \"sqlite\"\npath = \"keys.db\"\n{}",
            route(r#"["POST"]"#, "/orders", "")
        ),
    )
    .unwrap();
    let sqlite = sqlite.to_str().unwrap();
    // Creates the store, as serve would.
    let (code, err) = run_into_closed_pipe(&["check-config", "--connect", "-c", sqlite], &[]);
    assert_eq!((code, err.as_str()), (0, ""));
    for (args, want) in [
        (&["keys", "-c", sqlite, "show", "--anonymous", "k-1"][..], 3),
        (&["keys", "-c", sqlite, "delete", "--anonymous", "k-1"], 0),
        (&["keys", "-c", sqlite, "purge-expired"], 0),
    ] {
        let (code, err) = run_into_closed_pipe(args, &[]);
        assert_eq!(code, want, "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }

    let url = database_url();
    require_postgres(&url).await;
    let schema = unique_schema("pipe");
    let pg = dir.path().join("pg.toml");
    std::fs::write(
        &pg,
        format!(
            "{MINIMAL}[store]\nbackend = \"postgres\"\nurl = \"{url}\"\nschema = \"{schema}\"\n"
        ),
    )
    .unwrap();
    let (code, err) = run_into_closed_pipe(&["migrate", "-c", pg.to_str().unwrap()], &[]);
    drop_schema(&url, &schema).await;
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
