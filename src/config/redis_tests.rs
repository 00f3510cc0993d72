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
