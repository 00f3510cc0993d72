//! The real `idemgate` binary as a child process: `serve` in the background
//! ([`ServeProcess`]) and one-shot commands such as `check-config`, `keys`
//! and `migrate` ([`run_to_completion`]).
//!
//! Every run starts from an environment without `IDEMGATE_*` variables and
//! with `RUST_LOG=warn`, so only what the test passes counts.

use super::{bounded, wait_for, Req, DEADLINE};
use http::Method;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tokio::net::TcpStream;

/// `idemgate` with a clean `IDEMGATE_*` environment.
fn idemgate() -> Command {
    idemgate_via(&[])
}

/// `idemgate` run by the command `via` (e.g. `prlimit --nofile=1024:20000`),
/// with a clean `IDEMGATE_*` environment.
fn idemgate_via(via: &[&str]) -> Command {
    let bin = env!("CARGO_BIN_EXE_idemgate");
    let mut cmd = match via.split_first() {
        Some((program, args)) => {
            let mut cmd = Command::new(program);
            cmd.args(args).arg(bin);
            cmd
        }
        None => Command::new(bin),
    };
    for (k, _) in std::env::vars() {
        if k.starts_with("IDEMGATE_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("RUST_LOG", "warn");
    cmd
}

/// `idemgate` with a clean `IDEMGATE_*` environment, for a test that runs
/// it its own way (e.g. `demo`); the test kills what it spawns.
pub fn command() -> Command {
    idemgate()
}

// ===== one-shot commands =====

/// One run of the binary to completion.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `idemgate <args>` with `env` added to a clean `IDEMGATE_*`
/// environment; bounded by [`DEADLINE`].
pub async fn run_to_completion(args: &[&str], env: &[(&str, &str)]) -> Run {
    run_with(&[], None, args, env).await
}

/// Like [`run_to_completion`], run by the command `via` (see
/// [`ServeProcess::start_via`]).
pub async fn run_via(via: &[&str], args: &[&str], env: &[(&str, &str)]) -> Run {
    run_with(via, None, args, env).await
}

/// [`run_to_completion`] in the working directory `dir`.
pub async fn run_in(dir: Option<&Path>, args: &[&str], env: &[(&str, &str)]) -> Run {
    run_with(&[], dir, args, env).await
}

/// `idemgate <args>` run by `via`, in `dir` (the test's own when `None`).
async fn run_with(via: &[&str], dir: Option<&Path>, args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = idemgate_via(via);
    cmd.args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null());
    if let Some(dir) = dir {
        cmd.current_dir(dir);
    }
    let mut cmd = tokio::process::Command::from(cmd);
    cmd.kill_on_drop(true);
    let out = bounded(&format!("idemgate {args:?}"), cmd.output())
        .await
        .expect("run idemgate");
    Run {
        code: out.status.code().expect("exit code"),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Writes `text` to a temporary `checked.toml` and runs
/// `idemgate <args> --config <that file>`; returns the run and the file's
/// path (which error messages name).
pub async fn run_on_config_text(args: &[&str], text: &str, env: &[(&str, &str)]) -> (Run, String) {
    let dir = tempfile::TempDir::new().expect("tempdir");
    let file = dir.path().join("checked.toml");
    std::fs::write(&file, text).expect("write the config");
    let path = file.display().to_string();
    let mut all = args.to_vec();
    all.extend(["--config", path.as_str()]);
    (run_to_completion(&all, env).await, path)
}

// ===== serve =====

/// A running `idemgate serve`, killed on drop so a failing test leaves no
/// process behind. Its stderr goes to a file next to its config.
pub struct ServeProcess {
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    child: Option<Child>,
    stderr: PathBuf,
}

impl ServeProcess {
    /// Runs `serve --config <config>` with `env` added to a clean
    /// `IDEMGATE_*` environment; returns once `listen` (the proxy) and
    /// `admin` accept connections.
    pub async fn start(
        config: &Path,
        listen: SocketAddr,
        admin: SocketAddr,
        env: &[(&str, &str)],
    ) -> Self {
        Self::start_with(config, listen, admin, env, |_| {}).await
    }

    /// Like [`ServeProcess::start`], with a last change to the command.
    pub async fn start_with(
        config: &Path,
        listen: SocketAddr,
        admin: SocketAddr,
        env: &[(&str, &str)],
        tweak: impl FnOnce(&mut Command),
    ) -> Self {
        Self::spawn(idemgate(), config, listen, admin, env, tweak).await
    }

    /// Like [`ServeProcess::start`], run by the command `via`, e.g.
    /// `["prlimit", "--nofile=1024:20000"]` (util-linux).
    pub async fn start_via(
        via: &[&str],
        config: &Path,
        listen: SocketAddr,
        admin: SocketAddr,
        env: &[(&str, &str)],
    ) -> Self {
        Self::spawn(idemgate_via(via), config, listen, admin, env, |_| {}).await
    }

    async fn spawn(
        mut cmd: Command,
        config: &Path,
        listen: SocketAddr,
        admin: SocketAddr,
        env: &[(&str, &str)],
        tweak: impl FnOnce(&mut Command),
    ) -> Self {
        let stderr = config.with_extension(format!("{}.stderr", listen.port()));
        let file = std::fs::File::create(&stderr).expect("create the stderr file");
        cmd.arg("serve")
            .arg("--config")
            .arg(config)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file);
        tweak(&mut cmd);
        let child = cmd.spawn().expect("start idemgate serve");
        let mut process = Self {
            listen,
            admin,
            child: Some(child),
            stderr,
        };
        process.wait_accepting(listen).await;
        process.wait_accepting(admin).await;
        process
    }

    /// Waits for `addr` to accept, failing fast (with the log) if the
    /// process exits instead.
    async fn wait_accepting(&mut self, addr: SocketAddr) {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            if TcpStream::connect(addr).await.is_ok() {
                return;
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "idemgate exited ({status}) before listening on {addr}:\n{}",
                    self.log()
                );
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "idemgate did not listen on {addr} in time:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The process id (for /proc).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Everything the process wrote to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    pub fn url(&self, path_and_query: &str) -> String {
        format!("http://{}{}", self.listen, path_and_query)
    }

    pub fn post(&self, path_and_query: &str) -> Req {
        Req::new(Method::POST, self.url(path_and_query))
    }

    /// `GET` on the admin listener.
    pub fn admin_get(&self, path: &str) -> Req {
        Req::new(Method::GET, format!("http://{}{path}", self.admin))
    }

    /// Sends SIGTERM (what Kubernetes and `docker stop` send).
    pub fn terminate(&self) {
        let pid = self.child.as_ref().expect("running").id();
        let status = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM {pid} failed: {status}");
    }

    /// Sends SIGHUP (reload the config).
    pub fn hangup(&self) {
        let pid = self.child.as_ref().expect("running").id();
        let status = Command::new("kill")
            .args(["-HUP", &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -HUP {pid} failed: {status}");
    }

    /// SIGKILL, then reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits (bounded) for the process to exit and returns its exit code.
    pub async fn exited(&mut self) -> Option<i32> {
        let child = self.child.as_mut().expect("running");
        let status = wait_for("idemgate to exit", || {
            let s = child.try_wait().expect("try_wait");
            async move { s }
        })
        .await;
        self.child = None;
        status.code()
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
