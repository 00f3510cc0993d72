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
    // check-config lists what it skipped, by name only (a value may be an
    // address the operator did not mean to print), and nothing else.
    let skipped: Vec<&str> = run
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("skipped    "))
        .collect();
    assert_eq!(skipped.len(), 1, "{}", run.stdout);
    let (names, why) = skipped[0]
        .split_once(" (")
        .unwrap_or_else(|| panic!("{}", skipped[0]));
    let mut want: Vec<&str> = links.iter().map(|(name, _)| *name).collect();
    want.sort_unstable();
    assert_eq!(
        names.split(", ").collect::<Vec<_>>(),
        want,
        "{}",
        skipped[0]
    );
    assert!(
        why.starts_with("Kubernetes service-link variables"),
        "{why}"
    );
    // No address anywhere (the ports and `tcp` are parts of the names).
    for (_, value) in links.iter().filter(|(_, v)| v.contains('.')) {
        assert!(!run.stdout.contains(value), "{value}: {}", run.stdout);
    }
    // Without service links there is no such line.
    let (run, _) = run_on_config_text(
        &["check-config"],
        &text,
        &[("IDEMGATE_SERVER_UPSTREAM_TIMEOUT", "7s")],
    )
    .await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(!run.stdout.contains("skipped"), "{}", run.stdout);
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

/// Pins: `keys` without `--config` read `config/idemgate.toml` from the
/// working directory; a missing one must be an error, never a new store.
#[tokio::test]
async fn keys_without_a_config_refuses_and_creates_nothing() {
    let dir = tempfile::TempDir::new().expect("tempdir");
    let run = crate::support::process::run_in(
        Some(dir.path()),
        &["keys", "show", "--anonymous", "k-1"],
        &[],
    )
    .await;
    assert_eq!(run.code, 64, "{run:?}");
    assert!(
        run.stderr.contains("no config at config/idemgate.toml") && run.stderr.contains("--config"),
        "{}",
        run.stderr
    );
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "keys created {left:?}");
}

/// Pins: `--scope-header-value` on a route with two scope headers derived
/// another scope and said "no record". It is refused, saying how to name
/// each header; and the access log's `key.id` leads to the record: a key
/// and scope that do not give it are refused, naming a credential-free
/// scope that does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_name_the_scope_of_a_logged_request_or_say_why_not() {
    use crate::support::{free_port, process::ServeProcess, Route, TestConfig, Upstream, ORDERS};
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemgate.toml");
    let (listen, admin) = (free_port(), free_port());
    TestConfig::new(up.addr)
        .listen(listen, admin)
        .set("store.backend", "sqlite")
        .set("store.path", "keys.db")
        .set("log.level", "info")
        .set("log.format", "json")
        .route(Route::post(ORDERS).set("scope_headers", vec!["Authorization", "X-Tenant"]))
        .write(&path);
    let secret = [("IDEMGATE_SCOPE_SECRET", "a-long-enough-secret")];
    let serve_env = [secret[0], ("RUST_LOG", "info")];
    let gate = ServeProcess::start(&path, listen, admin, &serve_env).await;
    let sent = gate
        .post(ORDERS)
        .header("authorization", "Bearer t")
        .header("x-tenant", "t1")
        .key("k-logged")
        .body("{}")
        .send()
        .await;
    assert_eq!(sent.status(), 201, "{}", sent.text());
    let anonymous = gate.post(ORDERS).key("k-open").body("{}").send().await;
    assert_eq!(anonymous.status(), 201, "{}", anonymous.text());
    // The access log lines' key.id, in order.
    let mut ids = Vec::new();
    for _ in 0..50 {
        ids = gate
            .log()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|l| l["fields"]["message"] == "request" || l["message"] == "request")
            .filter_map(|l| {
                let id = l.pointer("/fields/key.id").or_else(|| l.get("key.id"))?;
                id.as_str().map(str::to_string)
            })
            .collect();
        if ids.len() == 2 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(
        ids.len(),
        2,
        "access log lines with key.id in:\n{}",
        gate.log()
    );
    let config = path.to_str().unwrap();
    let keys = |args: &[&str]| {
        let mut all = vec!["keys", "--config", config];
        all.extend_from_slice(args);
        all.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let run = |args: Vec<String>| async move {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        crate::support::process::run_to_completion(&args, &secret).await
    };

    let one = run(keys(&[
        "show",
        "--scope-header-value",
        "Bearer t",
        "k-logged",
    ]))
    .await;
    assert_eq!(one.code, 64, "{one:?}");
    assert!(
        one.stderr.contains("scopes keys by authorization,x-tenant")
            && one
                .stderr
                .contains("--scope-header 'authorization=...' --scope-header 'x-tenant=...'"),
        "{}",
        one.stderr
    );
    let each = [
        "show",
        "--scope-header",
        "Authorization=Bearer t",
        "--scope-header",
        "X-Tenant=t1",
        "--key-id",
        &ids[0],
        "k-logged",
    ];
    let found = run(keys(&each)).await;
    assert_eq!(found.code, 0, "{found:?}");
    assert!(
        found.stdout.contains(&format!("key id       {}\n", ids[0])),
        "{}",
        found.stdout
    );
    assert!(
        found.stdout.contains("status       201\n"),
        "{}",
        found.stdout
    );

    // The wrong tenant: refused, not "no record".
    let mut wrong = each;
    wrong[4] = "X-Tenant=t2";
    let refused = run(keys(&wrong)).await;
    assert_eq!(refused.code, 64, "{refused:?}");
    assert!(
        refused.stderr.contains(&format!(
            "key id {} is not this key in the scope named",
            ids[0]
        )),
        "{}",
        refused.stderr
    );
    // A request without the scope headers: the refusal names its scope.
    let guess = [
        "show",
        "--scope-header",
        "Authorization=Bearer t",
        "--key-id",
        &ids[1],
        "k-open",
    ];
    let named = run(keys(&guess)).await;
    assert_eq!(named.code, 64, "{named:?}");
    assert!(
        named.stderr.contains("it is this key with --anonymous"),
        "{}",
        named.stderr
    );
    let open = run(keys(&[
        "show",
        "--anonymous",
        "--key-id",
        &ids[1],
        "k-open",
    ]))
    .await;
    assert_eq!(open.code, 0, "{open:?}");
}

/// Pins: the scope was in no log line, so an operator holding an access
/// log line but not the client's credential could not name the record.
/// The line carries the scope's digest (never the credential or the key),
/// and `keys show` / `delete` take it with `--scope`, checked by the
/// line's `--key-id`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_line_names_the_scope_keys_commands_take() {
    use crate::support::{free_port, process::ServeProcess, Route, TestConfig, Upstream, ORDERS};
    const CREDENTIAL: &str = "Bearer sk_live_only-the-client-knows";
    const KEY: &str = "k-from-the-log";
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemgate.toml");
    let (listen, admin) = (free_port(), free_port());
    TestConfig::new(up.addr)
        .listen(listen, admin)
        .set("store.backend", "sqlite")
        .set("store.path", "keys.db")
        .set("log.level", "info")
        .set("log.format", "json")
        .route(Route::post(ORDERS))
        .write(&path);
    let secret = [("IDEMGATE_SCOPE_SECRET", "a-long-enough-secret")];
    let serve_env = [secret[0], ("RUST_LOG", "info")];
    let gate = ServeProcess::start(&path, listen, admin, &serve_env).await;
    let sent = gate
        .post(ORDERS)
        .header("authorization", CREDENTIAL)
        .key(KEY)
        .body("{}")
        .send()
        .await;
    assert_eq!(sent.status(), 201, "{}", sent.text());
    let keyless = gate.post(ORDERS).header("authorization", CREDENTIAL);
    assert_eq!(keyless.body("{}").send().await.status(), 400);

    // The access log lines' (key.id, scope), in order.
    let field = |l: &serde_json::Value, name: &str| {
        let v = l
            .pointer(&format!("/fields/{name}"))
            .or_else(|| l.get(name));
        v.and_then(|v| v.as_str()).map(str::to_string)
    };
    let mut lines = Vec::new();
    for _ in 0..50 {
        lines = gate
            .log()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|l| l["fields"]["message"] == "request" || l["message"] == "request")
            .map(|l| (field(&l, "key.id"), field(&l, "scope")))
            .collect();
        if lines.len() == 2 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let log = gate.log();
    assert_eq!(lines.len(), 2, "access log lines in:\n{log}");
    let (Some(key_id), Some(scope)) = lines[0].clone() else {
        panic!("no key.id or scope on the keyed request's line:\n{log}");
    };
    assert_eq!(scope.len(), 64, "{scope}");
    assert!(scope.bytes().all(|b| b.is_ascii_hexdigit()), "{scope}");
    // A request refused before its key was known has neither.
    assert_eq!(lines[1], (Some("-".into()), Some("-".into())), "{log}");
    for raw in [CREDENTIAL, "sk_live_only-the-client-knows", KEY] {
        assert!(!log.contains(raw), "{raw:?} logged:\n{log}");
    }

    let config = path.to_str().unwrap();
    let keys = |args: &[&str]| {
        let mut all = vec!["keys", "--config", config];
        all.extend_from_slice(args);
        all.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let run = |args: Vec<String>| async move {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        crate::support::process::run_to_completion(&args, &secret).await
    };
    let logged = ["--scope", &scope, "--key-id", &key_id, KEY];
    let shown = run(keys(&[&["show"][..], &logged].concat())).await;
    assert_eq!(shown.code, 0, "{shown:?}");
    for want in [
        format!("key id       {key_id}\n"),
        format!("scope        {scope}\n"),
        "status       201\n".to_string(),
    ] {
        assert!(
            shown.stdout.contains(&want),
            "{want:?} in:\n{}",
            shown.stdout
        );
    }
    // The same record as naming the credential.
    let by_credential = ["show", "--scope-header-value", CREDENTIAL, KEY];
    let named = run(keys(&by_credential)).await;
    assert_eq!(named.code, 0, "{named:?}");
    let ids = |out: &str| out.lines().take(2).collect::<Vec<_>>().join("\n");
    assert_eq!(ids(&named.stdout), ids(&shown.stdout));
    // Another key in that scope is refused by the line's key.id.
    let other = ["show", "--scope", &scope, "--key-id", &key_id, "k-other"];
    let refused = run(keys(&other)).await;
    assert_eq!(refused.code, 64, "{refused:?}");

    let deleted = run(keys(&[&["delete"][..], &logged].concat())).await;
    assert_eq!(deleted.code, 0, "{deleted:?}");
    assert_eq!(deleted.stdout, format!("deleted key id {key_id}\n"));
    let gone = run(keys(&[&["show"][..], &logged].concat())).await;
    assert_eq!(gone.code, 3, "{gone:?}");
}
