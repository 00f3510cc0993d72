//! Issue 17 defect 8: the file-descriptor limit reconciled with
//! `server.max_connections`, through the real binary started by
//! `prlimit` (util-linux) with the limits systemd and container runtimes
//! give services.

use crate::support::process::run_via;
use crate::support::{free_port, metric_value, Route, ServeProcess, TestConfig, Upstream, ORDERS};
use std::path::Path;
use std::time::Duration;
use tokio::net::TcpStream;

/// A config file for a memory-store proxy on fresh ports, with its
/// addresses.
fn config(
    up: &Upstream,
    dir: &Path,
) -> (
    std::path::PathBuf,
    std::net::SocketAddr,
    std::net::SocketAddr,
) {
    let (listen, admin) = (free_port(), free_port());
    let path = dir.join("idemgate.toml");
    TestConfig::new(up.addr)
        .listen(listen, admin)
        .set("store.backend", "memory")
        .set("server.max_connections", 10_000)
        // Idle clients must stay while the test looks.
        .set("server.header_read_timeout", "60s")
        .route(Route::post(ORDERS))
        .write(&path);
    (path, listen, admin)
}

/// `n` idle client connections to `addr`.
async fn idle_clients(addr: std::net::SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(TcpStream::connect(addr).await.expect("connect"));
    }
    out
}

/// `idemgate_open_connections` as the admin listener shows it.
async fn open_connections(gate: &ServeProcess) -> u64 {
    let m = gate.admin_get("/metrics").send().await.text();
    metric_value(&m, "idemgate_open_connections")
}

/// Pins defect 8: started with soft `RLIMIT_NOFILE` 1024 and hard 20000,
/// 1,100 idle client connections used up the descriptors, and a protected
/// POST could not reach the upstream (EMFILE: 502) or was not even
/// accepted. `serve` now raises the soft limit to the hard one at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_soft_fd_limit_of_1024_is_raised_so_1100_idle_clients_leave_room() {
    let up = Upstream::start().await;
    let dir = tempfile::TempDir::new().expect("tempdir");
    let (path, listen, admin) = config(&up, dir.path());
    let gate = ServeProcess::start_via(
        &["prlimit", "--nofile=1024:20000"],
        &path,
        listen,
        admin,
        &[("RUST_LOG", "info")],
    )
    .await;
    let limits =
        std::fs::read_to_string(format!("/proc/{}/limits", gate.pid())).expect("read /proc limits");
    let open_files = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files");
    assert!(
        open_files.split_whitespace().nth(3) == Some("20000"),
        "the soft limit is raised to the hard one: {open_files}"
    );
    let _idle = idle_clients(listen, 1100).await;
    crate::support::wait_for("the proxy to accept every idle client", || async {
        (open_connections(&gate).await >= 1100).then_some(())
    })
    .await;
    let resp = tokio::time::timeout(
        Duration::from_secs(10),
        gate.post(ORDERS).key("fd-1").body("{}").send(),
    )
    .await
    .expect("the POST is answered");
    assert_eq!(resp.status(), 201, "{}", resp.text());
    assert_eq!(up.hits(ORDERS), 1);
}

/// Pins defect 8 (a hard limit too low): with soft and hard 1024 and
/// `max_connections = 10000`, the proxy ran into EMFILE instead of a
/// limit. Now it lowers its connection limit to what 1024 descriptors hold
/// (4 per connection and tunnel slot plus what the config needs besides),
/// says so in the log and in `check-config`, and serves no more clients
/// at once than that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hard_fd_limit_too_low_lowers_max_connections_and_says_so() {
    let up = Upstream::start().await;
    let dir = tempfile::TempDir::new().expect("tempdir");
    let (path, listen, admin) = config(&up, dir.path());
    let via = ["prlimit", "--nofile=1024:1024"];
    let file = path.display().to_string();
    let check = run_via(&via, &["check-config", "--config", &file], &[]).await;
    assert_eq!(check.code, 0, "{check:?}");
    let said = "cannot hold server.max_connections = 10000";
    let warning = check
        .stdout
        .lines()
        .find(|l| l.starts_with("warning: ") && l.contains(said))
        .unwrap_or_else(|| panic!("check-config says the limit is lowered:\n{}", check.stdout));
    let lowered: u64 = warning
        .split("max_connections is lowered to ")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("a number in {warning}"));
    assert!((100..1024 / 4).contains(&lowered), "{warning}");

    let gate = ServeProcess::start_via(&via, &path, listen, admin, &[]).await;
    assert!(
        gate.log()
            .contains(&format!("max_connections is lowered to {lowered}")),
        "the log says so too:\n{}",
        gate.log()
    );
    let resp = gate.post(ORDERS).key("fd-2").body("{}").send().await;
    assert_eq!(resp.status(), 201);
    // The lowered limit is the one in force.
    let _idle = idle_clients(listen, lowered as usize + 20).await;
    crate::support::wait_for("the proxy to fill its connection slots", || async {
        (open_connections(&gate).await == lowered).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        open_connections(&gate).await,
        lowered,
        "no more than the lowered limit"
    );
}
