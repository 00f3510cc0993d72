//! The README's demo commands work as written: `idemgate demo` writes its
//! config beside its store and prints `keys --config <that file>`
//! commands, which find the demo's keys (exit 0) and report an absent
//! one with exit 3.

use crate::support::process::command;
use crate::support::{free_port, run_to_completion, wait_for, Req};
use http::Method;
use std::process::{Child, Stdio};

/// The demo process, killed on drop.
struct Demo(Child);

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_prints_keys_commands_that_find_its_keys() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("demo.db");
    let out = dir.path().join("demo.out");
    let listen = free_port();
    let child = command()
        .args(["demo", "--listen", &listen.to_string(), "--db"])
        .arg(&db)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .expect("start idemgate demo");
    let _demo = Demo(child);
    let config = dir.path().join("demo.toml");
    let shown = format!(
        "idemgate keys --config {} show --scope-header-value 'Bearer demo' order-1",
        config.display()
    );
    wait_for("the demo's walkthrough", || async {
        let printed = std::fs::read_to_string(&out).unwrap_or_default();
        printed.contains(&shown).then_some(())
    })
    .await;

    let order = Req::new(Method::POST, format!("http://{listen}/orders"))
        .header("authorization", "Bearer demo")
        .header("content-type", "application/json")
        .key("order-1")
        .body(r#"{"item":"book","qty":1}"#)
        .send()
        .await;
    assert_eq!(order.status(), 201, "{}", order.text());

    let config = config.to_str().unwrap();
    let show = |key: &'static str| {
        let args = [
            "keys",
            "--config",
            config,
            "show",
            "--scope-header-value",
            "Bearer demo",
            key,
        ];
        async move { run_to_completion(&args, &[]).await }
    };
    let found = show("order-1").await;
    assert_eq!(found.code, 0, "{}{}", found.stdout, found.stderr);
    assert!(
        found.stdout.contains("state        completed"),
        "{}",
        found.stdout
    );
    let absent = show("order-404").await;
    assert_eq!(absent.code, 3, "{}{}", absent.stdout, absent.stderr);
    assert!(absent.stdout.starts_with("no record"), "{}", absent.stdout);
}
