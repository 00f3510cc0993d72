//! `[redis]`: URL schemes (TLS, Valkey aliases), certificate files and
//! cluster mode, each mistake reported with file, line and field.

use crate::config::Config;

const BASE: &str = "[server]\nupstream = \"http://127.0.0.1:3000\"\n[store]\nbackend = \"postgres\"\nurl = \"postgres://db/app\"\n[redis]\n";

fn redis(section: &str) -> Result<crate::config::RedisConfig, String> {
    Config::parse(&format!("{BASE}{section}"), "t.toml")
        .map(|c| c.restart.redis.expect("[redis] is set"))
        .map_err(|e| e.to_string())
}

#[test]
fn the_scheme_picks_tls_and_valkey_schemes_are_aliases() {
    for (url, tls, client) in [
        ("redis://h:6379", false, "redis://h:6379"),
        ("rediss://h:6380/2", true, "rediss://h:6380/2"),
        ("valkey://:pw@h", false, "redis://:pw@h"),
        ("valkeys://h:6380", true, "rediss://h:6380"),
        ("unix:///run/redis.sock", false, "unix:///run/redis.sock"),
    ] {
        let cfg = redis(&format!("url = {url:?}")).unwrap();
        assert_eq!(cfg.is_tls(), tls, "{url}");
        assert_eq!(cfg.client_url(), client, "{url}");
        assert!(!cfg.cluster);
    }
    let e = redis("url = \"http://h:6379\"").unwrap_err();
    assert!(e.contains("rediss://"), "{e}");
}

#[test]
fn certificate_files_need_a_tls_url_and_come_in_pairs() {
    let ok = redis(
        "url = \"rediss://h\"\nca_file = \"ca.pem\"\ncert_file = \"c.pem\"\nkey_file = \"k.pem\"",
    )
    .unwrap();
    assert_eq!(ok.ca_file.as_deref(), Some("ca.pem".as_ref()));
    assert_eq!(ok.cert_file.as_deref(), Some("c.pem".as_ref()));
    assert_eq!(ok.key_file.as_deref(), Some("k.pem".as_ref()));
    assert!(ok.to_string().contains("TLS with CA ca.pem"), "{ok}");

    // BASE has 6 lines: the url is line 7, the next key line 8.
    for (section, want) in [
        (
            "url = \"redis://h\"\nca_file = \"ca.pem\"",
            "t.toml: line 8: redis.ca_file only applies to a TLS URL",
        ),
        (
            "url = \"valkey://h\"\nkey_file = \"k.pem\"",
            "t.toml: line 8: redis.key_file only applies to a TLS URL",
        ),
        (
            "url = \"rediss://h\"\ncert_file = \"c.pem\"",
            "t.toml: line 8: redis.cert_file is set without redis.key_file",
        ),
        (
            "url = \"rediss://h\"\n\nkey_file = \"k.pem\"",
            "t.toml: line 9: redis.key_file is set without redis.cert_file",
        ),
        (
            "url = \"unix:///run/redis.sock\"\ncluster = true",
            "t.toml: line 8: redis.cluster needs a TCP URL",
        ),
        ("url = \"rediss://h\"\nca_flie = \"x\"", "ca_flie"),
        ("url = \"rediss://h/#insecure\"", "redis.ca_file"),
    ] {
        let e = redis(section).unwrap_err();
        assert!(e.contains(want), "{section:?}: {e}");
    }
}

#[test]
fn cluster_mode_is_shown_and_passwords_stay_masked() {
    let cfg = redis("url = \"rediss://:swordfish@seed:6379\"\ncluster = true").unwrap();
    assert!(cfg.cluster);
    let shown = format!("{cfg}{cfg:?}");
    assert!(shown.contains("cluster"), "{shown}");
    assert!(shown.contains("TLS with the system roots"), "{shown}");
    assert!(!shown.contains("swordfish"), "{shown}");
}

#[test]
fn sentinel_names_the_master_instead_of_a_url() {
    let cfg = redis(
        "sentinels = [\"10.0.0.1:26379\", \"[fd00::2]:26380\"]\nsentinel_master = \"mymaster\"\nusername = \"app\"\npassword = \"swordfish\"\nsentinel_password = \"s3cret\"",
    )
    .unwrap();
    let s = cfg.sentinel.as_ref().expect("sentinel mode");
    assert_eq!(
        s.sentinels,
        [
            ("10.0.0.1".to_string(), 26379),
            ("fd00::2".to_string(), 26380)
        ]
    );
    assert_eq!(s.master, "mymaster");
    assert_eq!(s.username.as_deref(), Some("app"));
    assert_eq!(s.password.as_deref(), Some("swordfish"));
    assert!(!cfg.is_tls() && !cfg.cluster);
    let shown = format!("{cfg}{cfg:?}");
    assert!(
        shown.contains("sentinel master \"mymaster\" via 10.0.0.1:26379,[fd00::2]:26380"),
        "{shown}"
    );
    assert!(
        !shown.contains("swordfish") && !shown.contains("s3cret"),
        "{shown}"
    );

    let tls = redis(
        "sentinels = [\"s:26379\"]\nsentinel_master = \"m\"\ntls = true\nca_file = \"ca.pem\"",
    )
    .unwrap();
    assert!(tls.is_tls());
    assert_eq!(tls.ca_file.as_deref(), Some("ca.pem".as_ref()));
}

#[test]
fn sentinel_mistakes_name_their_field_and_line() {
    // BASE has 6 lines: the first key line is 7.
    for (section, want) in [
        (
            "sentinels = [\"s:26379\"]",
            "t.toml: line 7: redis.sentinels is set without redis.sentinel_master",
        ),
        (
            "sentinel_master = \"m\"",
            "t.toml: line 7: redis.sentinel_master is set without redis.sentinels",
        ),
        (
            "sentinels = [\"s:26379\"]\nsentinel_master = \"m\"\ncluster = true",
            "t.toml: line 9: redis.cluster and redis.sentinels do not go together",
        ),
        (
            "url = \"redis://h\"\nsentinels = [\"s:26379\"]\nsentinel_master = \"m\"",
            "t.toml: line 8: redis.sentinels and redis.url do not go together",
        ),
        (
            "sentinels = []\nsentinel_master = \"m\"",
            "t.toml: line 7: redis.sentinels is empty",
        ),
        (
            "sentinels = [\"s\"]\nsentinel_master = \"m\"",
            "t.toml: line 7: redis.sentinels: expected \"host:port\"",
        ),
        (
            "sentinels = [\"::1:26379\"]\nsentinel_master = \"m\"",
            "(\"[::1]:26379\" for IPv6)",
        ),
        (
            "sentinels = [\"s:0\"]\nsentinel_master = \"m\"",
            "redis.sentinels: expected \"host:port\"",
        ),
        (
            "sentinels = [\"s:1\"]\nsentinel_master = \"\"",
            "t.toml: line 8: redis.sentinel_master must be non-empty",
        ),
        (
            "url = \"redis://h\"\npassword = \"pw\"",
            "t.toml: line 8: redis.password only applies with redis.sentinels",
        ),
        (
            "url = \"rediss://h\"\ntls = true",
            "t.toml: line 8: redis.tls only applies with redis.sentinels",
        ),
        (
            "sentinels = [\"s:1\"]\nsentinel_master = \"m\"\nca_file = \"ca.pem\"",
            "t.toml: line 9: redis.ca_file only applies to a TLS URL (rediss:// or valkeys://) or redis.tls = true with Sentinel",
        ),
        ("timeout = \"1s\"", "redis.url (or redis.sentinels"),
    ] {
        let e = redis(section).unwrap_err();
        assert!(e.contains(want), "{section:?}: {e}");
        assert!(!e.contains("pw\""), "{e}");
    }
}
