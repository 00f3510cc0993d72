use super::*;
use std::path::PathBuf;

const MINIMAL: &str = "[server]\nupstream = \"http://127.0.0.1:3000\"\n";

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse(text, "test.toml")
}

fn err(text: &str) -> String {
    parse(text)
        .expect_err("config should be rejected")
        .to_string()
}

fn with_route(route: &str) -> String {
    format!("{MINIMAL}[[route]]\nmethods = [\"POST\"]\npath = \"/orders\"\n{route}")
}

#[test]
fn shipped_example_parses_and_uses_every_default() {
    let text = include_str!("../../config/idemgate.toml");
    let cfg = parse(text).expect("config/idemgate.toml must parse");
    assert_eq!(cfg.server.listen.to_string(), DEFAULT_LISTEN);
    assert_eq!(cfg.server.upstream_timeout, DEFAULT_UPSTREAM_TIMEOUT);
    assert_eq!(cfg.server.max_connections, DEFAULT_MAX_CONNECTIONS);
    assert_eq!(cfg.server.shutdown_grace, DEFAULT_SHUTDOWN_GRACE);
    assert_eq!(cfg.store.backend, Backend::Sqlite);
    assert_eq!(cfg.store.path, PathBuf::from(DEFAULT_SQLITE_PATH));
    assert_eq!(cfg.store.timeout, DEFAULT_STORE_TIMEOUT);
    assert_eq!(cfg.store.sweep_batch, DEFAULT_SWEEP_BATCH);
    let routes: Vec<_> = cfg.routes.iter().collect();
    assert_eq!(routes.len(), 2);
    let r = &routes[0];
    assert_eq!(r.ttl, DEFAULT_TTL);
    assert_eq!(r.lease, DEFAULT_LEASE);
    assert_eq!(r.key_header.as_str(), "idempotency-key");
    assert_eq!(r.scope_header.as_str(), "authorization");
    assert_eq!(r.max_request_body, DEFAULT_MAX_REQUEST_BODY);
    assert_eq!(r.max_response_body, DEFAULT_MAX_RESPONSE_BODY);
    assert!(r.require_key);
    assert_eq!(r.on_store_error, OnStoreError::Reject);
    assert_eq!(routes[1].ttl, Duration::from_secs(48 * 3600));
}

#[test]
fn the_file_without_its_examples_is_the_built_in_defaults() {
    let cfg = parse(MINIMAL).unwrap();
    assert!(cfg.admin.is_none());
    assert!(cfg.redis.is_none());
    assert_eq!(cfg.log.format, LogFormat::Text);
    assert_eq!(cfg.routes.iter().count(), 0);
}

#[test]
fn defaults_apply_to_routes_and_routes_override_them() {
    let text = format!(
        "{MINIMAL}[defaults]\nttl = \"2h\"\nlease = \"5s\"\nrequire_key = false\n\
         [[route]]\nmethods = [\"POST\"]\npath = \"/a\"\n\
         [[route]]\nmethods = [\"POST\"]\npath = \"/b\"\nttl = \"3h\"\nrequire_key = true\n"
    );
    let cfg = parse(&text).unwrap();
    let r: Vec<_> = cfg.routes.iter().collect();
    assert_eq!(
        (r[0].ttl, r[0].lease, r[0].require_key),
        (Duration::from_secs(7200), Duration::from_secs(5), false)
    );
    assert_eq!(
        (r[1].ttl, r[1].require_key),
        (Duration::from_secs(3 * 3600), true)
    );
}

/// Each bad input names the file and the field or line.
#[test]
fn errors_name_file_line_and_field() {
    let cases: &[(&str, &[&str])] = &[
        (
            &format!("{MINIMAL}colour = \"blue\"\n"),
            &["test.toml", "line 3", "colour"],
        ),
        (
            "[server]\nupstream = \"ftp://x\"\n",
            &["test.toml", "line 2", "ftp"],
        ),
        (
            "[server]\nupstream = \"not a url\"\n",
            &["line 2", "upstream URL"],
        ),
        (
            "[server]\nlisten = \"127.0.0.1:8080\"\n",
            &["server.upstream is required"],
        ),
        (
            &with_route("ttl = \"30\"\n"),
            &["line 6", "unit is required"],
        ),
        (
            &with_route("lease = \"5 parsecs\"\n"),
            &["line 6", "parsecs"],
        ),
        (
            &with_route("max_request_body = \"lots\"\n"),
            &["line 6", "invalid size"],
        ),
        (
            &with_route("require_key = \"yes\"\n"),
            &["line 6", "require_key"],
        ),
        (
            &with_route("on_store_error = \"panic\"\n"),
            &["line 6", "panic"],
        ),
        (
            &format!("{MINIMAL}[[route]]\nmethods = [\"post\"]\npath = \"/o\"\n"),
            &["line 4", "invalid method"],
        ),
        (
            &format!("{MINIMAL}[[route]]\nmethods = [\"POST\"]\npath = \"orders\"\n"),
            &["line 5", "must start with '/'"],
        ),
        (
            &format!("{MINIMAL}[[route]]\npath = \"/o\"\n"),
            &["route #1", "`methods` is required"],
        ),
        (
            &format!(
                "{MINIMAL}[[route]]\nmethods = [\"POST\"]\npath = \"/o/{{id}}\"\n\
                 [[route]]\nmethods = [\"PUT\", \"POST\"]\npath = \"/o/{{x}}\"\n"
            ),
            &["line 6", "route #2", "duplicate route", "route #1"],
        ),
        (
            &with_route("lease = \"100ms\"\n"),
            &["route #1", "too short"],
        ),
        (
            &with_route("ttl = \"10s\"\nlease = \"30s\"\n"),
            &["ttl", "at least the lease"],
        ),
        (
            &with_route("scope_header = \"bad header\"\n"),
            &["invalid header name"],
        ),
        (
            &format!("{MINIMAL}[defaults]\npath = \"/x\"\n"),
            &["defaults", "belong in a [[route]]"],
        ),
        (
            &format!("{MINIMAL}[store]\nbackend = \"postgres\"\n"),
            &["store.url is required"],
        ),
        (
            &format!("{MINIMAL}[store]\nbackend = \"sqlite\"\nurl = \"postgres://x\"\n"),
            &["line 5", "store.url only applies"],
        ),
        (
            &format!("{MINIMAL}[store]\nbackend = \"mysql\"\n"),
            &["line 4", "mysql"],
        ),
        (
            &format!("{MINIMAL}[redis]\nurl = \"redis://127.0.0.1\"\n"),
            &["needs store.backend = \"postgres\""],
        ),
        (
            &format!("{MINIMAL}[log]\nformat = \"xml\"\n"),
            &["line 4", "xml"],
        ),
        ("[server\n", &["test.toml", "line 1"]),
    ];
    for (text, needles) in cases {
        let msg = err(text);
        for needle in *needles {
            assert!(
                msg.contains(needle),
                "{needle:?} not in error for\n{text}\n--> {msg}"
            );
        }
    }
}

#[test]
fn environment_overrides_urls_and_addresses() {
    let text = format!("{MINIMAL}[store]\nbackend = \"postgres\"\n");
    let env: BTreeMap<String, String> = [
        ("IDEMGATE_STORE_URL", "postgres://u:hunter2@db:5432/app"),
        ("IDEMGATE_REDIS_URL", "redis://cache:6379"),
        ("IDEMGATE_UPSTREAM", "http://app:9000"),
        ("IDEMGATE_LISTEN", "0.0.0.0:8081"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let cfg = Config::parse_with_env(&text, "t.toml", &env).unwrap();
    assert_eq!(
        cfg.store.url.as_deref(),
        Some("postgres://u:hunter2@db:5432/app")
    );
    assert_eq!(cfg.redis.as_ref().unwrap().url, "redis://cache:6379");
    assert_eq!(cfg.server.upstream.to_string(), "http://app:9000/");
    assert_eq!(cfg.server.listen.to_string(), "0.0.0.0:8081");
    let shown = cfg.describe();
    assert!(shown.contains("postgres://u:****@db:5432/app"), "{shown}");
    assert!(!shown.contains("hunter2"));
}

#[test]
fn passwords_are_masked() {
    assert_eq!(mask_url("postgres://u:pw@h/db"), "postgres://u:****@h/db");
    assert_eq!(mask_url("redis://h:6379"), "redis://h:6379");
    assert_eq!(mask_url("redis://:pw@h:6379"), "redis://:****@h:6379");
    assert_eq!(
        mask_url("postgres://u@h/db?sslmode=disable&password=pw"),
        "postgres://u@h/db?sslmode=disable&password=****"
    );
    assert_eq!(mask_url("postgres://u:a@b@h/db"), "postgres://u:****@h/db");
}

/// The deployment examples must stay valid configs.
#[test]
fn deployment_configs_parse() {
    let env: BTreeMap<String, String> = [
        (
            "IDEMGATE_STORE_URL",
            "postgres://idemgate:pw@postgres:5432/idemgate",
        ),
        ("IDEMGATE_REDIS_URL", "redis://redis:6379"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let compose = include_str!("../../config/compose.toml");
    let cfg = Config::parse_with_env(compose, "config/compose.toml", &env).unwrap();
    assert_eq!(cfg.store.backend, Backend::Postgres);
    assert!(cfg.redis.is_some());
    Config::parse(
        include_str!("../../config/docker.toml"),
        "config/docker.toml",
    )
    .unwrap();

    let manifest = include_str!("../../deploy/kubernetes/sidecar.yaml");
    let start =
        manifest.find("idemgate.toml: |").expect("ConfigMap entry") + "idemgate.toml: |".len();
    let end = start + manifest[start..].find("\n---").expect("end of ConfigMap");
    let embedded: String = manifest[start..end]
        .lines()
        .map(|l| l.strip_prefix("    ").unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n");
    let cfg = Config::parse_with_env(&embedded, "deploy/kubernetes/sidecar.yaml", &env).unwrap();
    assert_eq!(cfg.routes.iter().count(), 2);
    assert!(cfg.admin.is_some());
}

#[test]
fn scope_secret_comes_from_the_environment_and_is_never_shown() {
    let env = |v: &str| -> BTreeMap<String, String> {
        [("IDEMGATE_SCOPE_SECRET".to_string(), v.to_string())].into()
    };
    let short = Config::parse_with_env(MINIMAL, "t.toml", &env("short")).unwrap_err();
    assert!(short.to_string().contains("at least 16"), "{short}");
    let cfg = Config::parse_with_env(MINIMAL, "t.toml", &env("a-long-enough-secret")).unwrap();
    assert_eq!(
        cfg.scope_secret.as_ref().unwrap().expose(),
        b"a-long-enough-secret"
    );
    assert!(cfg.describe().contains("HMAC-SHA256"));
    assert!(!format!("{cfg:?}").contains("a-long-enough-secret"));
    assert!(!cfg.describe().contains("a-long-enough-secret"));
}

#[test]
fn any_section_key_can_come_from_the_environment() {
    let env: BTreeMap<String, String> = [
        ("IDEMGATE_SERVER_UPSTREAM_TIMEOUT", "5s"),
        ("IDEMGATE_SERVER_PRESERVE_HOST", "true"),
        ("IDEMGATE_STORE_SWEEP_BATCH", "50"),
        ("IDEMGATE_ADMIN_LISTEN", "127.0.0.1:9999"),
        ("IDEMGATE_LOG_FORMAT", "json"),
        (
            "IDEMGATE_TEST_DATABASE_URL",
            "ignored: not a config section",
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let cfg = Config::parse_with_env(MINIMAL, "t.toml", &env).unwrap();
    assert_eq!(cfg.server.upstream_timeout, Duration::from_secs(5));
    assert!(cfg.server.preserve_host);
    assert_eq!(cfg.store.sweep_batch, 50);
    assert_eq!(cfg.admin.unwrap().listen.to_string(), "127.0.0.1:9999");
    assert_eq!(cfg.log.format, LogFormat::Json);

    for (name, value, needle) in [
        ("IDEMGATE_SERVER_COLOUR", "blue", "unknown field `colour`"),
        ("IDEMGATE_SERVER_UPSTREAM_TIMEOUT", "30", "unit is required"),
        (
            "IDEMGATE_STORE_POOL_SIZE",
            "many",
            "IDEMGATE_STORE_POOL_SIZE",
        ),
    ] {
        let env = [(name.to_string(), value.to_string())].into();
        let e = Config::parse_with_env(MINIMAL, "t.toml", &env)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(name) && e.contains(needle),
            "{needle:?} not in {e}"
        );
        if needle.starts_with("unknown field") {
            // A secret set under a wrong name is not printed.
            assert!(!e.contains(value), "the value is echoed: {e}");
        }
    }
    // A value that is not one TOML value is a plain string: a newline cannot
    // smuggle in other sections.
    let sneaky = "\"x\"\n[server]\nupstream = \"http://evil:1\"";
    let env = [("IDEMGATE_LOG_LEVEL".to_string(), sneaky.to_string())].into();
    let e = Config::parse_with_env(MINIMAL, "t.toml", &env)
        .unwrap_err()
        .to_string();
    assert!(e.contains("log.level"), "{e}");
}
