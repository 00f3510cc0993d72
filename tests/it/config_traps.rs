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
