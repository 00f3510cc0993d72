//! A relative `store.path` is read from the config file's directory, so
//! `serve`, `keys`, `check-config` and `migrate` open the same SQLite file
//! from any working directory; `keys` never creates a store (a missing
//! file is an error naming it), and a store an earlier version kept in the
//! working directory is not silently replaced by a new, empty one.

use crate::support::process::run_in;
use crate::support::{free_port, Route, ServeProcess, TestConfig, Upstream, ORDERS};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// A config in `dir` whose store is `data/idemgate.db` (relative); its
/// path and the proxy's and admin's addresses.
fn write_config(dir: &Path, upstream: SocketAddr) -> (PathBuf, SocketAddr, SocketAddr) {
    let config = dir.join("idemgate.toml");
    let (listen, admin) = (free_port(), free_port());
    TestConfig::new(upstream)
        .set("store.backend", "sqlite")
        .set("store.path", "data/idemgate.db")
        .route(Route::post(ORDERS))
        .listen(listen, admin)
        .write(&config);
    (config, listen, admin)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_run_from_another_directory_act_on_the_proxys_store_file() {
    let (proxy_dir, serve_cwd, keys_cwd) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let up = Upstream::start().await;
    let (config, listen, admin) = write_config(proxy_dir.path(), up.addr);
    let serve = ServeProcess::start_with(&config, listen, admin, &[], |cmd| {
        cmd.current_dir(serve_cwd.path());
    })
    .await;
    let stored = serve.post(ORDERS).key("order-1").body("{}").send().await;
    assert_eq!(stored.status(), 201, "{}", stored.text());
    let store = proxy_dir.path().join("data/idemgate.db");
    assert!(store.exists(), "serve keeps its store beside its config");

    let config = config.to_str().unwrap();
    let keys = |action: &'static str| {
        let args = ["keys", "--config", config, action, "--anonymous", "order-1"];
        let cwd = keys_cwd.path().to_path_buf();
        async move { run_in(Some(&cwd), &args, &[]).await }
    };
    let shown = keys("show").await;
    assert_eq!(shown.code, 0, "{shown:?}");
    assert!(shown.stdout.contains("state        completed"), "{shown:?}");
    let deleted = keys("delete").await;
    assert_eq!(deleted.code, 0, "{deleted:?}");
    assert!(deleted.stdout.starts_with("deleted key id"), "{deleted:?}");
    // It was the proxy's record: the key runs again.
    let again = serve.post(ORDERS).key("order-1").body("{}").send().await;
    assert_eq!(again.status(), 201);
    assert!(!again.replayed());
    assert_eq!(up.hits(ORDERS), 2);
    for cwd in [serve_cwd.path(), keys_cwd.path()] {
        assert!(!cwd.join("data").exists(), "nothing in {}", cwd.display());
    }

    // check-config names the file every command opens.
    let check = run_in(
        Some(keys_cwd.path()),
        &["check-config", "--config", config],
        &[],
    )
    .await;
    assert_eq!(check.code, 0, "{check:?}");
    assert!(
        check.stdout.contains(&store.display().to_string()),
        "{check:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_on_a_missing_store_file_fails_naming_the_path_and_creates_nothing() {
    let (proxy_dir, cwd) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (config, _, _) = write_config(proxy_dir.path(), "127.0.0.1:9".parse().unwrap());
    let config = config.to_str().unwrap();
    for action in [
        &["delete", "--anonymous", "order-1"][..],
        &["show", "--anonymous", "order-1"],
        &["purge-expired"],
    ] {
        let args = [&["keys", "--config", config][..], action].concat();
        let run = run_in(Some(cwd.path()), &args, &[]).await;
        assert_ne!(run.code, 0, "{action:?}: {run:?}");
        assert_ne!(run.code, 3, "not \"no record\": {run:?}");
        let missing = proxy_dir.path().join("data/idemgate.db");
        assert!(
            run.stderr.contains(&missing.display().to_string()),
            "{action:?}: {run:?}"
        );
        assert!(!run.stdout.contains("no record"), "{run:?}");
    }
    assert!(!proxy_dir.path().join("data").exists(), "no store created");
    assert!(!cwd.path().join("data").exists(), "no store created");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_left_in_the_working_directory_is_not_replaced_by_an_empty_one() {
    let (proxy_dir, cwd) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (config, _, _) = write_config(proxy_dir.path(), "127.0.0.1:9".parse().unwrap());
    // Where an earlier version, started from `cwd`, kept the store.
    std::fs::create_dir(cwd.path().join("data")).unwrap();
    std::fs::write(cwd.path().join("data/idemgate.db"), b"").unwrap();
    let config = config.to_str().unwrap();
    for args in [
        &["check-config", "--config", config][..],
        &["serve", "--config", config],
    ] {
        let run = run_in(Some(cwd.path()), args, &[]).await;
        assert_eq!(run.code, 64, "{args:?}: {run:?}");
        assert!(
            run.stderr.contains("store.path")
                && run.stderr.contains(
                    &proxy_dir
                        .path()
                        .join("data/idemgate.db")
                        .display()
                        .to_string()
                )
                && run.stderr.contains("absolute path"),
            "{run:?}"
        );
    }
    assert!(!proxy_dir.path().join("data").exists(), "no store created");
}
