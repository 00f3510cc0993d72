//! The book's shell examples work as written. Every ```sh block of
//! `docs/book/src/*.md` is read from the book (never copied here) and is
//! either run below against the real binary, or listed in [`BLOCKS`] with
//! why it cannot run here. A run block's commands run with `sh`, in a
//! directory holding `config/idemgate.toml` (the default `--config`, so a
//! command without one finds it as on a host), with the binary under test
//! first on `PATH`; only addresses, file paths, `<placeholders>` and sample
//! values (a key id, `k3:...`) are replaced, each by what the text says to
//! take (an access log line's `scope` and `key.id`, a generated key). Each
//! command is held to what its comment and the prose say it prints or
//! does. A new block, or a new command in a run block, fails here until it
//! is run or said to be illustrative.
//!
//! README.md's blocks are listed too (its walkthrough runs in
//! tests/it/doc_commands.rs).
//!
//! Covered (see [`BLOCKS`] for the exact list):
//! - operations.md, the `keys --config data/demo.toml` block: against
//!   `idemgate demo`;
//! - operations.md, the `keys` block against "your own proxy's config" and
//!   the `--scope <scope> --key-id <key.id>` block: against `serve` with
//!   the records each line names made through the proxy;
//! - encryption.md, both blocks: a key generated as shown, then the
//!   rotation (check-config --connect census, `keys reencrypt`);
//! - deploy.md's `check-config --connect` (PostgreSQL);
//! - webhooks.md's walkthrough: the config it writes, the two processes
//!   it starts, and each numbered step held to its comment;
//! - consumers.md's RabbitMQ walkthrough: against a private RabbitMQ node
//!   with the management plugin (for `rabbitmqadmin`) on free ports, which
//!   the block's `RABBITMQ_*` variables name, each command held to its
//!   comment;
//! - in the prose of configuration.md and operations.md,
//!   `idemgate check-config --config FILE` and
//!   `idemgate reload --config FILE` (they sit in no block).
//!
//! Not run here: `docker compose` (no engine here, and nothing checks
//! docker-compose.yml yet) and `kubectl` (no cluster; deploy/check.sh
//! renders and validates the manifests offline), `scripts/test.sh`,
//! `soak.sh` and `fuzz.sh` (minutes by design; CI runs the suite), and,
//! within the keys block, `--client-cert alice.pem` (needs a TLS listener
//! with a client CA: tests/it/tls_listener.rs runs it). consumers.md's
//! NATS paragraph is prose, not a block: it uses the `nats` CLI, which is
//! not installed here (tests/it/consumers.rs runs the same steps through
//! async-nats: a stream, a durable, a duplicate suppressed).

use crate::support::process::{command, Run, ServeProcess};
use crate::support::services::{database_url, drop_schema, require_postgres, unique_schema};
use crate::support::{bounded, free_port, wait_for, Req, Upstream};
use http::Method;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};

/// How a block of the book is covered: `(page, a fragment only that block
/// of the page has, coverage)`.
const BLOCKS: &[(&str, &str, Coverage)] = &[
    (
        "consumers.md",
        "declare queue name=orders.dlq",
        Coverage::Run("consumers_md_walkthrough_runs_a_duplicated_message_once"),
    ),
    (
        "containers.md",
        "docker compose up",
        Coverage::NotHere(
            "needs a Docker engine (none here); nothing in the suite validates docker-compose.yml yet",
        ),
    ),
    (
        "containers.md",
        "kubectl apply -f deploy/kubernetes/sidecar.yaml",
        Coverage::NotHere("needs a cluster; deploy/check.sh renders and validates the manifests"),
    ),
    (
        "containers.md",
        "kubectl apply -k deploy/kustomize/overlays/postgres",
        Coverage::NotHere("needs a cluster; deploy/check.sh runs kubectl kustomize on the overlay"),
    ),
    (
        "deploy.md",
        "check-config --connect --config /etc/idemgate/idemgate.toml",
        Coverage::Run("deploy_md_check_config_connect_tries_the_store_and_changes_nothing"),
    ),
    (
        "encryption.md",
        "openssl rand -base64 32",
        Coverage::Run(
            "encryption_md_a_key_made_as_shown_seals_and_the_rotation_moves_every_record",
        ),
    ),
    (
        "encryption.md",
        "now remove k2",
        Coverage::Run(
            "encryption_md_a_key_made_as_shown_seals_and_the_rotation_moves_every_record",
        ),
    ),
    (
        "operations.md",
        "--config data/demo.toml",
        Coverage::Run("operations_md_keys_commands_find_the_demos_keys"),
    ),
    (
        "operations.md",
        "keys purge-expired",
        Coverage::Run("operations_md_keys_commands_work_on_your_own_proxys_config"),
    ),
    (
        "operations.md",
        "--scope <scope> --key-id <key.id>",
        Coverage::Run("operations_md_keys_commands_work_on_your_own_proxys_config"),
    ),
    (
        "README.md",
        "cargo run --release -- demo",
        Coverage::NotHere(
            "a release build takes minutes; the demo it starts is what doc_commands.rs and demo_docs.rs run, and scripts/test.sh is the suite",
        ),
    ),
    (
        "README.md",
        "# 1. A new key",
        Coverage::Run("doc_commands::the_readme_curl_walkthrough_answers_as_its_comments_say"),
    ),
    (
        "tests.md",
        "scripts/test.sh",
        Coverage::NotHere("the whole suite (minutes); CI runs it"),
    ),
    (
        "tests.md",
        "scripts/soak.sh",
        Coverage::NotHere("300 s of load by default"),
    ),
    (
        "tests.md",
        "scripts/fuzz.sh",
        Coverage::NotHere("cargo-fuzz on nightly, 60 s per target"),
    ),
    (
        "webhooks.md",
        "preset = \"github\"",
        Coverage::Run("webhooks_md_walkthrough_answers_as_its_comments_say"),
    ),
];

#[derive(Debug)]
enum Coverage {
    /// Run by the test of that name, in this file (or `module::name`).
    Run(&'static str),
    /// Not run by this suite, and why.
    NotHere(&'static str),
}

/// A command of a block: continuation lines joined, its `# comment` apart
/// (a line with only a comment is a command with no text).
#[derive(Debug, Clone)]
struct Cmd {
    /// Its first line in the page.
    line: usize,
    text: String,
    comment: String,
}

#[derive(Debug)]
struct Block {
    page: String,
    /// The line of its opening fence.
    line: usize,
    raw: String,
    cmds: Vec<Cmd>,
}

impl Block {
    fn at(&self, cmd: &Cmd) -> String {
        format!("{}:{}: {}", self.page, cmd.line, cmd.text)
    }
}

fn book() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/book/src")
}

/// Every ```sh block of the book, page by page, and of README.md (a
/// block inside a list item has its indentation removed).
fn sh_blocks() -> Vec<Block> {
    let mut pages: Vec<PathBuf> = std::fs::read_dir(book())
        .expect("read docs/book/src")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    pages.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"));
    let mut out = Vec::new();
    for path in pages {
        let text = std::fs::read_to_string(&path).expect("read a page");
        let page = path.file_name().unwrap().to_str().unwrap().to_string();
        let lines: Vec<&str> = text.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            let fence = lines[i].trim_start();
            if !fence.starts_with("```") {
                i += 1;
                continue;
            }
            let indent = lines[i].len() - fence.len();
            let lang = fence[3..].trim();
            let mut j = i + 1;
            while j < lines.len() && lines[j].trim() != "```" {
                j += 1;
            }
            if lang == "sh" {
                let body: Vec<(usize, String)> = (i + 1..j)
                    .map(|k| {
                        let line = lines[k];
                        let cut = line.len() - line.trim_start().len();
                        (k + 1, line[cut.min(indent)..].to_string())
                    })
                    .collect();
                let raw = body.iter().map(|(_, l)| format!("{l}\n")).collect();
                out.push(Block {
                    page: page.clone(),
                    line: i + 1,
                    raw,
                    cmds: commands(&body),
                });
            }
            i = j + 1;
        }
    }
    out
}

/// The block of `page` whose text has `fragment`.
fn block(page: &str, fragment: &str) -> Block {
    let mut found: Vec<Block> = sh_blocks()
        .into_iter()
        .filter(|b| b.page == page && b.raw.contains(fragment))
        .collect();
    assert_eq!(
        found.len(),
        1,
        "{page}: one ```sh block with {fragment:?}, found {}",
        found.len()
    );
    found.remove(0)
}

/// A line's command and its comment: a `#` outside quotes that starts a
/// word starts the comment.
fn split_comment(line: &str) -> (&str, &str) {
    let (mut single, mut double, mut word_start) = (false, false, true);
    for (i, c) in line.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '#' if !single && !double && word_start => {
                return (line[..i].trim_end(), line[i + 1..].trim());
            }
            _ => {}
        }
        word_start = c.is_whitespace();
    }
    (line.trim_end(), "")
}

fn commands(body: &[(usize, String)]) -> Vec<Cmd> {
    let mut out = Vec::new();
    let mut pending: Option<Cmd> = None;
    for (n, line) in body {
        let (code, comment) = split_comment(line);
        let cmd = pending.get_or_insert_with(|| Cmd {
            line: *n,
            text: String::new(),
            comment: String::new(),
        });
        if !comment.is_empty() {
            if !cmd.comment.is_empty() {
                cmd.comment.push(' ');
            }
            cmd.comment.push_str(comment);
        }
        match code.strip_suffix('\\') {
            Some(head) => {
                cmd.text.push_str(head.trim());
                cmd.text.push(' ');
            }
            None => {
                cmd.text.push_str(code.trim());
                let done = pending.take().expect("a command");
                if !done.text.is_empty() || !done.comment.is_empty() {
                    out.push(done);
                }
            }
        }
    }
    out.extend(pending);
    out
}

/// The argument after `flag` in `cmd` (one shell word, quotes removed).
fn arg_after(cmd: &str, flag: &str) -> Option<String> {
    let rest = cmd.split(&format!("{flag} ")).nth(1)?.trim_start();
    Some(match rest.chars().next()? {
        q @ ('\'' | '"') => rest[1..].split(q).next()?.to_string(),
        _ => rest.split_whitespace().next()?.to_string(),
    })
}

/// Every argument after each `flag` in `cmd`.
fn args_after(cmd: &str, flag: &str) -> Vec<String> {
    let pieces: Vec<&str> = cmd.split(&format!("{flag} ")).collect();
    (1..pieces.len())
        .filter_map(|i| arg_after(&format!("{flag} {}", pieces[i..].join(" ")), flag))
        .collect()
}

/// The last word: the idempotency key a `keys` command names.
fn last_word(cmd: &str) -> String {
    cmd.split_whitespace().last().expect("a word").to_string()
}

/// Runs `script` with `sh` in `dir`: the binary under test is `idemgate`
/// on `PATH`, no `IDEMGATE_*` variable but `env`'s.
async fn sh(dir: &Path, script: &str, env: &[(&str, &str)]) -> Run {
    let bin = Path::new(env!("CARGO_BIN_EXE_idemgate"));
    let path = format!(
        "{}:{}",
        bin.parent().expect("the binary's directory").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = tokio::process::Command::new("sh");
    cmd.arg("-c")
        .arg(script)
        .current_dir(dir)
        .env("PATH", path)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    for (k, _) in std::env::vars() {
        if k.starts_with("IDEMGATE_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().copied());
    let out = bounded(&format!("sh -c {script:?}"), cmd.output())
        .await
        .expect("run sh");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A child process, killed on drop.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The value of `show`'s line `name` (`key id`, `scope`, ...).
fn shown<'a>(out: &'a str, name: &str) -> Option<&'a str> {
    out.lines()
        .find_map(|l| l.strip_prefix(name).filter(|r| r.starts_with("  ")))
        .map(str::trim)
}

#[test]
fn every_sh_block_is_run_or_says_why_not() {
    let blocks = sh_blocks();
    assert!(blocks.len() >= 10, "{blocks:#?}");
    for b in &blocks {
        let entries: Vec<_> = BLOCKS
            .iter()
            .filter(|(page, fragment, _)| b.page == *page && b.raw.contains(fragment))
            .collect();
        assert_eq!(
            entries.len(),
            1,
            "{}:{}: a ```sh block must match one entry of BLOCKS (run it in this file, or say why it cannot run here); matches {entries:?}\n{}",
            b.page,
            b.line,
            b.raw
        );
    }
    let sources = [
        ("book_commands", include_str!("book_commands.rs")),
        ("doc_commands", include_str!("doc_commands.rs")),
    ];
    for (page, fragment, coverage) in BLOCKS {
        let n = blocks
            .iter()
            .filter(|b| b.page == *page && b.raw.contains(fragment))
            .count();
        assert_eq!(n, 1, "BLOCKS: {page} has {n} blocks with {fragment:?}");
        match coverage {
            Coverage::Run(test) => {
                let (module, name) = test.split_once("::").unwrap_or(("book_commands", test));
                let source = sources
                    .iter()
                    .find(|(m, _)| *m == module)
                    .unwrap_or_else(|| panic!("BLOCKS: no module {module}"))
                    .1;
                assert!(
                    source.contains(&format!("async fn {name}()")),
                    "BLOCKS names no test {test}"
                );
            }
            Coverage::NotHere(why) => assert!(!why.is_empty(), "{page}: say why"),
        }
    }
}

#[test]
fn a_block_is_read_as_commands_and_comments() {
    let body: Vec<(usize, String)> = [
        "idemgate keys show --reason \"a # b\" k   # the comment",
        "idemgate keys show --scope-header 'A=b' \\",
        "                   --scope-header C=d k   # joined",
        "# only a comment",
        "",
    ]
    .iter()
    .enumerate()
    .map(|(i, l)| (i + 1, l.to_string()))
    .collect();
    let cmds = commands(&body);
    assert_eq!(cmds.len(), 3, "{cmds:?}");
    assert_eq!(cmds[0].text, "idemgate keys show --reason \"a # b\" k");
    assert_eq!(cmds[0].comment, "the comment");
    assert_eq!(
        cmds[1].text,
        "idemgate keys show --scope-header 'A=b' --scope-header C=d k"
    );
    assert_eq!((cmds[1].line, cmds[1].comment.as_str()), (2, "joined"));
    assert_eq!(
        (cmds[2].text.as_str(), cmds[2].comment.as_str()),
        ("", "only a comment")
    );
    assert_eq!(args_after(&cmds[1].text, "--scope-header"), ["A=b", "C=d"]);
}

// ===== operations.md: keys =====

/// `idemgate keys --config data/demo.toml show|delete ...` while
/// `idemgate demo` runs in the same directory (its default `--db`, so its
/// config is `data/demo.toml` there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_md_keys_commands_find_the_demos_keys() {
    let block = block("operations.md", "--config data/demo.toml");
    let dir = tempfile::tempdir().unwrap();
    let listen = free_port();
    let printed = dir.path().join("demo.out");
    let child = command()
        .args(["demo", "--listen", &listen.to_string()])
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&printed).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .expect("start idemgate demo");
    let _demo = Killed(child);
    wait_for("the demo to listen", || async {
        let text = std::fs::read_to_string(&printed).unwrap_or_default();
        text.contains("idemgate demo: proxy on").then_some(())
    })
    .await;

    let cmds: Vec<&Cmd> = block.cmds.iter().filter(|c| !c.text.is_empty()).collect();
    assert_eq!(cmds.len(), 2, "show, then delete: {:?}", block.cmds);
    let show = cmds[0];
    let delete = cmds[1];
    assert!(show
        .text
        .starts_with("idemgate keys --config data/demo.toml show "));
    assert!(delete
        .text
        .starts_with("idemgate keys --config data/demo.toml delete "));
    // The request the commands name, as the demo's walkthrough sends it.
    let credential = arg_after(&show.text, "--scope-header-value").expect("a scope");
    let key = last_word(&show.text);
    let sent = Req::new(Method::POST, format!("http://{listen}/orders"))
        .header("authorization", &credential)
        .header("content-type", "application/json")
        .key(&key)
        .body(r#"{"item":"book"}"#)
        .send()
        .await;
    assert_eq!(sent.status(), 201, "{}", sent.text());

    let run = sh(dir.path(), &show.text, &[]).await;
    assert_eq!(run.code, 0, "{}: {run:?}", block.at(show));
    // The comment lists what show prints: "state, fingerprint, ..., lease
    // (in flight only), ...": each a line, a lease only in flight.
    let fields: Vec<&str> = show.comment.split(", ").collect();
    assert!(fields.len() >= 6, "{}", show.comment);
    for field in fields {
        match field.split_once(" (") {
            Some((name, "in flight only)")) => {
                assert!(
                    !run.stdout.lines().any(|l| l.starts_with(name)),
                    "{}: a completed record has no {name} line:\n{}",
                    block.at(show),
                    run.stdout
                );
            }
            _ => assert!(
                run.stdout.lines().any(|l| l.starts_with(field)),
                "{}: no {field:?} line:\n{}",
                block.at(show),
                run.stdout
            ),
        }
    }
    assert_eq!(shown(&run.stdout, "state"), Some("completed"));

    let run = sh(dir.path(), &delete.text, &[]).await;
    assert_eq!(run.code, 0, "{}: {run:?}", block.at(delete));
    assert!(run.stdout.starts_with("deleted key id "), "{run:?}");
    let run = sh(dir.path(), &show.text, &[]).await;
    assert_eq!(run.code, 3, "deleted, so no record: {run:?}");
    assert!(run.stdout.starts_with("no record for key id "), "{run:?}");
}

/// A proxy's config, as `config/idemgate.toml` under `dir`, its SQLite
/// store beside it; the access log as JSON at `info`.
fn own_config(dir: &Path, listen: &str, admin: &str, upstream: &str, routes: &str) -> PathBuf {
    let config = dir.join("config");
    std::fs::create_dir_all(&config).unwrap();
    let path = config.join("idemgate.toml");
    std::fs::write(
        &path,
        format!(
            "[server]\nlisten = \"{listen}\"\nupstream = \"http://{upstream}\"\n\
             [admin]\nlisten = \"{admin}\"\n\
             [store]\nbackend = \"sqlite\"\npath = \"keys.db\"\n\
             [log]\nlevel = \"info\"\nformat = \"json\"\n{routes}"
        ),
    )
    .unwrap();
    path
}

/// `serve` on `config/idemgate.toml` of `dir`, logging requests.
async fn serve(dir: &Path, upstream: &str, routes: &str, env: &[(&str, &str)]) -> ServeProcess {
    let (listen, admin) = (free_port(), free_port());
    let path = own_config(
        dir,
        &listen.to_string(),
        &admin.to_string(),
        upstream,
        routes,
    );
    let mut all = vec![("RUST_LOG", "info")];
    all.extend_from_slice(env);
    ServeProcess::start(&path, listen, admin, &all).await
}

/// The access log lines' `(key.id, scope)`, in order.
fn access_lines(gate: &ServeProcess) -> Vec<(String, String)> {
    gate.log()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|l| l["message"] == "request")
        .map(|l| {
            let field = |name: &str| l[name].as_str().unwrap_or_default().to_string();
            (field("key.id"), field("scope"))
        })
        .collect()
}

/// Sends `req`; its status and its access log line's `(key.id, scope)`.
async fn logged(gate: &ServeProcess, req: Req) -> (u16, (String, String)) {
    let before = access_lines(gate).len();
    let status = req.send().await.status();
    let line = wait_for("the request's access log line", || async {
        access_lines(gate).get(before).cloned()
    })
    .await;
    (status, line)
}

/// operations.md's `keys` block "against your own proxy's config" and the
/// block after it (`--scope <scope> --key-id <key.id>`, from an access log
/// line): every line, in the book's order, on the records the lines name,
/// made through the proxy first. `--client-cert alice.pem` is not run
/// (tests/it/tls_listener.rs runs it: it needs a TLS listener with a
/// client CA). The `--scope-header NAME=VALUE` line runs on a second
/// proxy whose route scopes keys by those headers: on such a config
/// `--scope-header-value` is refused, as the page says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_md_keys_commands_work_on_your_own_proxys_config() {
    let own = block("operations.md", "keys purge-expired");
    let from_log = block("operations.md", "--scope <scope> --key-id <key.id>");
    let texts = |b: &Block| -> Vec<String> { b.cmds.iter().map(|c| c.text.clone()).collect() };
    let all = [texts(&own), texts(&from_log)].concat().join("\n");
    let credential = arg_after(&all, "--scope-header-value").expect("a --scope-header-value");
    let value = arg_after(&all, "--scope-value").expect("a --scope-value");
    let (preset, hook) = value.split_once(':').expect("--scope-value PRESET:PATH");
    let headers: Vec<(String, String)> = args_after(&all, "--scope-header")
        .iter()
        .map(|h| {
            let (n, v) = h.split_once('=').expect("--scope-header NAME=VALUE");
            (n.to_string(), v.to_string())
        })
        .collect();
    assert!(headers.len() >= 2, "{all}");
    // The keys the resolve lines name: on a route kept on an ambiguous
    // outcome (the upstream resets before answering: 502, outcome unknown).
    let unknown: std::collections::BTreeSet<String> = all
        .lines()
        .filter(|l| l.starts_with("idemgate keys resolve "))
        .map(last_word)
        .collect();

    let up = Upstream::start().await;
    let upstream = up.addr.to_string();
    let dir = tempfile::tempdir().unwrap();
    let routes = format!(
        "[[route]]\nmethods = [\"POST\"]\npath = \"/orders\"\n\
         [[route]]\nmethods = [\"POST\"]\npath = \"/pay\"\non_ambiguous = \"keep\"\n\
         [[route]]\npath = \"{hook}\"\npreset = \"{preset}\"\n"
    );
    let gate = serve(dir.path(), &upstream, &routes, &[]).await;
    // What each record was made by: (key, how its scope is named) → the
    // access log line's (key.id, scope).
    let mut made: BTreeMap<(String, &str), (String, String)> = BTreeMap::new();
    let order = |key: &str| {
        gate.post("/orders")
            .header("authorization", &credential)
            .key(key)
            .body("{}")
    };
    let (status, line) = logged(&gate, order("order-1")).await;
    assert_eq!(status, 201);
    made.insert(("order-1".into(), "credential"), line);
    for key in &unknown {
        let pay = gate
            .post("/pay?reset=before")
            .header("authorization", &credential)
            .key(key)
            .body("{}");
        let (status, line) = logged(&gate, pay).await;
        assert_eq!(status, 502, "{key}");
        made.insert((key.clone(), "credential"), line);
    }
    let (status, line) = logged(&gate, gate.post("/orders").key("order-1").body("{}")).await;
    assert_eq!(status, 201);
    made.insert(("order-1".into(), "anonymous"), line);
    let event = gate
        .post(hook)
        .header("content-type", "application/json")
        .body(r#"{"id":"evt_1","object":"event","pending_webhooks":1}"#);
    let (status, line) = logged(&gate, event).await;
    assert_eq!(status, 200);
    made.insert(("evt_1".into(), "value"), line);

    // The second proxy, its route scoped by the headers the line names.
    let several = tempfile::tempdir().unwrap();
    let names: Vec<String> = headers.iter().map(|(n, _)| format!("{n:?}")).collect();
    let routes = format!(
        "[[route]]\nmethods = [\"POST\"]\npath = \"/orders\"\nscope_headers = [{}]\n",
        names.join(", ")
    );
    let other = serve(several.path(), &upstream, &routes, &[]).await;
    let mut req = other.post("/orders").key("order-1").body("{}");
    for (n, v) in &headers {
        req = req.header(n, v);
    }
    let (status, line) = logged(&other, req).await;
    assert_eq!(status, 201);
    made.insert(("order-1".into(), "headers"), line);

    let keys = [(
        "IDEMGATE_STORE_ENCRYPTION_KEYS",
        "k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=",
    )];
    let mut ran = 0;
    for (block, cmd) in own
        .cmds
        .iter()
        .map(|c| (&own, c))
        .chain(from_log.cmds.iter().map(|c| (&from_log, c)))
    {
        let at = block.at(cmd);
        let text = &cmd.text;
        if text.is_empty() {
            continue;
        }
        assert!(text.starts_with("idemgate keys "), "{at}");
        if text.contains("--client-cert") {
            continue; // tests/it/tls_listener.rs
        }
        let key = last_word(text);
        let how = if text.contains("--anonymous") {
            "anonymous"
        } else if text.contains("--scope-value") {
            "value"
        } else if text.contains("--scope-header ") {
            "headers"
        } else {
            "credential"
        };
        let cwd = if how == "headers" {
            several.path()
        } else {
            dir.path()
        };
        let logged_line = made.get(&(key.clone(), how)).cloned();
        // The placeholders, from the access log line, as the page says.
        let mut script = text.clone();
        if let Some((key_id, scope)) = &logged_line {
            if let Some(sample) = arg_after(text, "--key-id") {
                if sample != "<key.id>" {
                    assert!(
                        sample.len() == 16 && sample.bytes().all(|b| b.is_ascii_hexdigit()),
                        "{at}: a sample key id is 16 hex digits, as the log's"
                    );
                }
                script =
                    script.replace(&format!("--key-id {sample}"), &format!("--key-id {key_id}"));
            }
            if let Some(start) = script.find("--scope <") {
                let end = start + script[start..].find('>').expect("a closing >") + 1;
                script.replace_range(start..end, &format!("--scope {scope}"));
            }
        }
        assert!(!script.contains('<'), "{at}: a placeholder left: {script}");
        let verb = text.split_whitespace().nth(2).expect("a keys command");
        match verb {
            "show" => {
                let (key_id, scope) = logged_line.unwrap_or_else(|| panic!("{at}: no record made"));
                let run = sh(cwd, &script, &[]).await;
                assert_eq!(run.code, 0, "{at}: {run:?}");
                // The record that request made, no other.
                assert_eq!(shown(&run.stdout, "key id"), Some(key_id.as_str()), "{at}");
                assert_eq!(shown(&run.stdout, "scope"), Some(scope.as_str()), "{at}");
            }
            "delete" => {
                let (key_id, _) = logged_line.unwrap_or_else(|| panic!("{at}: no record made"));
                let run = sh(cwd, &script, &[]).await;
                assert_eq!(run.code, 0, "{at}: {run:?}");
                assert_eq!(
                    run.stdout.trim(),
                    format!("deleted key id {key_id}"),
                    "{at}"
                );
                let again = script.replace(" delete ", " show ");
                let run = sh(cwd, &again, &[]).await;
                assert_eq!(run.code, 3, "{at}: gone: {run:?}");
                // Made again, for the lines after.
                assert_eq!(how, "credential", "{at}");
                let (status, line) = logged(&gate, order(&key)).await;
                assert_eq!(status, 201, "{at}");
                made.insert((key.clone(), "credential"), line);
            }
            "resolve" => {
                let (key_id, _) = logged_line.unwrap_or_else(|| panic!("{at}: no record made"));
                let run = sh(cwd, &script, &[]).await;
                assert_eq!(run.code, 0, "{at}: {run:?}");
                let hits = up.hits("/pay");
                let retry = gate
                    .post("/pay?reset=before")
                    .header("authorization", &credential)
                    .key(&key)
                    .body("{}");
                let (status, line) = logged(&gate, retry).await;
                if text.contains("--not-applied") {
                    assert_eq!(
                        run.stdout.trim(),
                        format!("resolved key id {key_id} as not applied: released, the next request with it executes"),
                        "{at}"
                    );
                    // "the next retry executes": it reaches the upstream
                    // (which resets again: unknown again).
                    assert!(
                        cmd.comment.is_empty() || cmd.comment.contains("executes"),
                        "{at}: {}",
                        cmd.comment
                    );
                    assert_eq!((status, up.hits("/pay")), (502, hits + 1), "{at}");
                } else {
                    assert!(text.contains("--applied"), "{at}");
                    assert!(
                        run.stdout
                            .starts_with(&format!("resolved key id {key_id} as applied")),
                        "{at}: {run:?}"
                    );
                    // "retries get 410, never execute".
                    assert!(
                        cmd.comment.is_empty() || cmd.comment.contains("410"),
                        "{at}: {}",
                        cmd.comment
                    );
                    assert_eq!((status, up.hits("/pay")), (410, hits), "{at}");
                }
                made.insert((key.clone(), "credential"), line);
            }
            "purge-expired" => {
                let run = sh(cwd, &script, &[]).await;
                assert_eq!(run.code, 0, "{at}: {run:?}");
                assert_eq!(run.stdout.trim(), "deleted 0 expired records", "{at}");
            }
            "reencrypt" => {
                // "with IDEMGATE_STORE_ENCRYPTION_KEYS": without, refused.
                assert!(
                    cmd.comment.contains("IDEMGATE_STORE_ENCRYPTION_KEYS"),
                    "{at}"
                );
                let run = sh(cwd, &script, &[]).await;
                assert_eq!(run.code, 1, "{at}: {run:?}");
                assert!(
                    run.stderr
                        .contains("IDEMGATE_STORE_ENCRYPTION_KEYS is not set"),
                    "{run:?}"
                );
                let run = sh(cwd, &script, &keys).await;
                assert_eq!(run.code, 0, "{at}: {run:?}");
                assert!(
                    run.stdout.contains("under key id \"k1\""),
                    "{at}: {}",
                    run.stdout
                );
                assert!(
                    run.stdout.contains("reencrypt: done: "),
                    "{at}: {}",
                    run.stdout
                );
            }
            other => panic!("{at}: `keys {other}` is not run here: add it"),
        }
        ran += 1;
    }
    assert!(ran >= 12, "ran {ran} commands");
    // Neither a key nor the credential reached a log.
    for log in [gate.log(), other.log()] {
        assert!(!log.contains(&credential), "the credential logged");
        for (k, _) in made.keys() {
            assert!(!log.contains(&format!("\"{k}\"")), "key {k} logged");
        }
    }
}

// ===== encryption.md =====

/// The ID:BASE64 entries of an `IDEMGATE_STORE_ENCRYPTION_KEYS` list, as
/// ids in order.
fn key_ids(list: &str) -> Vec<String> {
    list.split(',')
        .map(|e| e.split(':').next().unwrap().trim().to_string())
        .collect()
}

/// The census line's `by configured key id: ...` list.
fn census(out: &str) -> String {
    let line = out
        .lines()
        .find(|l| l.starts_with("connect: sealed records"))
        .unwrap_or_else(|| panic!("no census line:\n{out}"));
    let list = line.split("by configured key id: ").nth(1).expect("a list");
    list[..list.find(';').expect("a ;")].to_string()
}

/// A comment's claims about the census: `k2 1200, k3 (current) 40; ...`
/// → the ids with their `(current)`, and the literal parts (`under key
/// ids not configured (410): 0`); `...` parts are elided.
fn census_claims(comment: &str) -> (Vec<String>, Vec<String>) {
    let (mut ids, mut literal) = (Vec::new(), Vec::new());
    for part in comment.split("; ") {
        let part = part.trim();
        if part == "..." {
            continue;
        }
        let entries = part.rsplit_once("key id: ").map_or(part, |(_, e)| e);
        let parsed: Option<Vec<String>> = entries
            .split(", ")
            .map(|e| {
                let words: Vec<&str> = e.split_whitespace().collect();
                match words.as_slice() {
                    [id, "(current)", n] if n.parse::<u64>().is_ok() => {
                        Some(format!("{id} (current)"))
                    }
                    [id, n] if n.parse::<u64>().is_ok() => Some(id.to_string()),
                    _ => None,
                }
            })
            .collect();
        match parsed {
            Some(p) => ids.extend(p),
            None => literal.push(part.to_string()),
        }
    }
    (ids, literal)
}

/// encryption.md: the key made as the first block makes it seals what the
/// proxy stores; then "Rotating a key now", line by line, with the
/// census `check-config --connect` prints held to each comment (the ids
/// and which is current; the counts are this test's records).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encryption_md_a_key_made_as_shown_seals_and_the_rotation_moves_every_record() {
    let make = block("encryption.md", "openssl rand -base64 32");
    let rotate = block("encryption.md", "now remove k2");
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let routes = "[[route]]\nmethods = [\"POST\"]\npath = \"/orders\"\n";
    own_config(
        dir.path(),
        "127.0.0.1:1",
        "127.0.0.1:2",
        &up.addr.to_string(),
        routes,
    );

    let export = make
        .cmds
        .iter()
        .find(|c| c.text.starts_with("export IDEMGATE_STORE_ENCRYPTION_KEYS="))
        .expect("the export line");
    let got = sh(
        dir.path(),
        &format!(
            "{}\nprintf %s \"$IDEMGATE_STORE_ENCRYPTION_KEYS\"",
            export.text
        ),
        &[],
    )
    .await;
    assert_eq!(got.code, 0, "{}", got.stderr);
    let first = got.stdout;
    let first_id = key_ids(&first)[0].clone();
    let checked = sh(
        dir.path(),
        &format!("{}\nidemgate check-config", export.text),
        &[],
    )
    .await;
    assert_eq!(checked.code, 0, "{checked:?}");
    assert!(
        checked.stdout.contains(&format!(
            "responses  sealed at rest (AES-256-GCM) under key {first_id:?}; 1 key(s) open them"
        )),
        "{}",
        checked.stdout
    );

    // A proxy under that key stores three responses.
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    {
        let gate = serve(
            dir.path(),
            &up.addr.to_string(),
            routes,
            &[("IDEMGATE_STORE_ENCRYPTION_KEYS", first.as_str())],
        )
        .await;
        for key in ["r-1", "r-2", "r-3"] {
            let r = gate.post("/orders").key(key).body("{}").send().await;
            assert_eq!(r.status(), 201);
        }
    }
    *counts.entry(first_id.clone()).or_default() += 3;

    // The rotation's list: `k3:...,k2:...`, its `...` a new key and the
    // one made above.
    let mut lines = rotate.cmds.iter();
    let export = lines.next().expect("the export line");
    let sample = export
        .text
        .strip_prefix("export IDEMGATE_STORE_ENCRYPTION_KEYS=")
        .expect("export IDEMGATE_STORE_ENCRYPTION_KEYS=...")
        .trim_matches('"');
    let ids = key_ids(sample);
    assert_eq!(ids.len(), 2, "{sample}");
    assert_eq!(
        ids[1], first_id,
        "the rotation moves from the key made above"
    );
    let new = sh(dir.path(), "openssl rand -base64 32", &[]).await.stdout;
    let list = format!("{}:{},{first}", ids[0], new.trim());
    // Rolled out to the proxies first: one response under the new key.
    let gate = serve(
        dir.path(),
        &up.addr.to_string(),
        routes,
        &[("IDEMGATE_STORE_ENCRYPTION_KEYS", list.as_str())],
    )
    .await;
    let r = gate.post("/orders").key("r-4").body("{}").send().await;
    assert_eq!(r.status(), 201);
    *counts.entry(ids[0].clone()).or_default() += 1;

    let env = [("IDEMGATE_STORE_ENCRYPTION_KEYS", list.as_str())];
    let mut ran = 0;
    for cmd in lines {
        let at = rotate.at(cmd);
        let current = |id: &String| {
            if *id == ids[0] {
                format!("{id} (current)")
            } else {
                id.clone()
            }
        };
        if cmd.text.is_empty() {
            // "now remove k2 from every replica's list": the census with
            // the new key alone finds nothing it cannot open.
            let gone = cmd
                .comment
                .split_whitespace()
                .skip_while(|w| *w != "remove")
                .nth(1)
                .expect("remove ID");
            assert_eq!(gone, first_id, "{at}");
            let alone = format!("{}:{}", ids[0], new.trim());
            let run = sh(
                dir.path(),
                "idemgate check-config --connect",
                &[("IDEMGATE_STORE_ENCRYPTION_KEYS", alone.as_str())],
            )
            .await;
            assert_eq!(run.code, 0, "{at}: {run:?}");
            assert_eq!(
                census(&run.stdout),
                format!("{} (current) 4", ids[0]),
                "{at}"
            );
            assert!(
                run.stdout.contains("under key ids not configured (410): 0"),
                "{at}: {}",
                run.stdout
            );
            ran += 1;
            continue;
        }
        let run = sh(dir.path(), &cmd.text, &env).await;
        assert_eq!(run.code, 0, "{at}: {run:?}");
        if cmd.text == "idemgate check-config --connect" {
            let (claimed, literal) = census_claims(&cmd.comment);
            let want: Vec<String> = counts
                .iter()
                .filter(|(_, n)| **n > 0)
                .map(|(id, n)| format!("{} {n}", current(id)))
                .collect();
            let claimed_ids: Vec<String> = want
                .iter()
                .map(|w| w.rsplit_once(' ').unwrap().0.to_string())
                .collect();
            assert_eq!(claimed, claimed_ids, "{at}: the comment's ids");
            assert_eq!(census(&run.stdout), want.join(", "), "{at}");
            for part in literal {
                assert!(
                    run.stdout.contains(&part),
                    "{at}: {part:?} in\n{}",
                    run.stdout
                );
            }
        } else if cmd.text == "idemgate keys reencrypt" {
            let batch = arg_after(&cmd.comment, "--batch").expect("--batch N in the comment");
            assert!(
                run.stdout
                    .contains(&format!("under key id {:?}, {batch} per page", ids[0])),
                "{at}: {}",
                run.stdout
            );
            let moved = counts.remove(&first_id).unwrap_or(0);
            assert!(
                run.stdout.contains(&format!(
                    "reencrypt: done: {moved} rewritten, 1 already current"
                )),
                "{at}: {}",
                run.stdout
            );
            *counts.entry(ids[0].clone()).or_default() += moved;
        } else {
            panic!("{at}: not run here: add it");
        }
        ran += 1;
    }
    assert_eq!(ran, 4, "check-config, reencrypt, check-config, the removal");
    drop(gate);
}

// ===== deploy.md =====

/// `IDEMGATE_STORE_URL='postgres://…' idemgate check-config --connect
/// --config /etc/idemgate/idemgate.toml`: the URL and the path replaced,
/// it connects, says TLS or plaintext and `synchronous_commit`, and
/// changes nothing (no schema made).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deploy_md_check_config_connect_tries_the_store_and_changes_nothing() {
    let block = block(
        "deploy.md",
        "check-config --connect --config /etc/idemgate/idemgate.toml",
    );
    let cmds: Vec<&Cmd> = block.cmds.iter().filter(|c| !c.text.is_empty()).collect();
    assert_eq!(cmds.len(), 1, "{:?}", block.cmds);
    let cmd = cmds[0];
    let url = database_url();
    require_postgres(&url).await;
    let schema = unique_schema("book");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("idemgate.toml");
    std::fs::write(
        &file,
        format!("[server]\nupstream = \"http://127.0.0.1:3000\"\n[store]\nbackend = \"postgres\"\nschema = \"{schema}\"\n"),
    )
    .unwrap();
    assert!(cmd.text.contains("'postgres://…'"), "{}", block.at(cmd));
    let script = cmd
        .text
        .replace("'postgres://…'", &format!("'{url}'"))
        .replace("/etc/idemgate/idemgate.toml", file.to_str().unwrap());
    let run = sh(dir.path(), &script, &[]).await;
    // No migration: the schema was not made.
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let task = tokio::spawn(conn);
    let made = client
        .query_one(
            "SELECT count(*) FROM information_schema.schemata WHERE schema_name = $1",
            &[&schema],
        )
        .await
        .unwrap()
        .get::<_, i64>(0);
    drop(client);
    let _ = task.await;
    drop_schema(&url, &schema).await;
    assert_eq!(run.code, 0, "{}: {run:?}", block.at(cmd));
    assert_eq!(made, 0, "check-config --connect made schema {schema}");
    let connect: Vec<&str> = run
        .stdout
        .lines()
        .filter(|l| l.starts_with("connect: postgres"))
        .collect();
    assert!(
        connect
            .iter()
            .any(|l| l.contains(": ok, over TLS (TLS 1.") || l.contains("plaintext")),
        "TLS (and which version) or plaintext: {connect:?}"
    );
    assert!(
        connect.iter().any(|l| l.contains("synchronous_commit is ")),
        "{connect:?}"
    );
}

// ===== commands in the prose =====

/// The backticked `idemgate ...` command of `page` that starts with
/// `start`, and the sentence it is in.
fn prose_command(page: &str, start: &str) -> (String, String) {
    let text = std::fs::read_to_string(book().join(page)).expect("read the page");
    let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let at = flat
        .find(&format!("`{start}"))
        .unwrap_or_else(|| panic!("{page} names no `{start}...`"));
    let command = &flat[at + 1..];
    let command = &command[..command.find('`').expect("a closing `")];
    let sentence = &flat[at..];
    let sentence = &sentence[..sentence.find(". ").unwrap_or(sentence.len())];
    (command.to_string(), sentence.to_string())
}

/// configuration.md: "`idemgate check-config --config FILE` validates a
/// file and prints the effective settings and route table (exit 0), or
/// prints the error and exits 64"; operations.md: "`idemgate reload
/// --config FILE` ... prints `config reloaded`".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_commands_in_the_prose_do_what_it_says() {
    let (check, said) = prose_command("configuration.md", "idemgate check-config --config FILE");
    assert!(
        said.contains("(exit 0)") && said.contains("exits 64"),
        "{said}"
    );
    let (reload, said_reload) = prose_command("operations.md", "idemgate reload --config FILE");
    assert!(
        said_reload.contains("prints `config reloaded`"),
        "{said_reload}"
    );

    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let routes = "[[route]]\nmethods = [\"POST\"]\npath = \"/orders\"\n";
    let gate = serve(dir.path(), &up.addr.to_string(), routes, &[]).await;
    let file = dir.path().join("config/idemgate.toml");
    let file = file.to_str().unwrap();
    let run = sh(dir.path(), &check.replace("FILE", file), &[]).await;
    assert_eq!(run.code, 0, "{check}: {run:?}");
    assert!(
        run.stdout.starts_with(&format!("{file}: ok\n")),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("\nroutes:\n  #1 POST /orders "),
        "{}",
        run.stdout
    );

    let run = sh(dir.path(), &reload.replace("FILE", file), &[]).await;
    assert_eq!(run.code, 0, "{reload}: {run:?}");
    assert!(run.stdout.contains("config reloaded"), "{run:?}");

    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[server]\nupstream = \"http://127.0.0.1:3000\"\nbogus = 1\n",
    )
    .unwrap();
    let run = sh(
        dir.path(),
        &check.replace("FILE", bad.to_str().unwrap()),
        &[],
    )
    .await;
    assert_eq!(run.code, 64, "{run:?}");
    assert!(run.stderr.contains("bogus"), "{run:?}");
    drop(gate);
}

// ===== webhooks.md =====

/// webhooks.md's "Walkthrough: a redelivered webhook": the lines before
/// step 1 write the config (its path and both addresses moved to a
/// temporary file and free ports) and start `demo-upstream` and `serve`
/// in the background, which this test starts itself (and stops); then
/// each numbered step runs with `sh` and is held to its comment as the
/// README's walkthrough is (tests/it/doc_commands.rs); the last step,
/// which prints no heads, counts the orders its comment names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_md_walkthrough_answers_as_its_comments_say() {
    use crate::doc_commands::{answers, expectations, run_shell, steps};
    let block = block("webhooks.md", "preset = \"github\"");
    let dir = tempfile::tempdir().unwrap();
    let (proxy, upstream) = (free_port(), free_port());
    let config = dir.path().join("hooks.toml");
    let mut raw = block
        .raw
        .replace("/tmp/hooks.toml", config.to_str().unwrap());
    for (port, to) in [("8080", proxy), ("3000", upstream)] {
        for host in ["127.0.0.1", "localhost"] {
            raw = raw.replace(&format!("{host}:{port}"), &to.to_string());
        }
    }
    let first = raw.find("\n# 1. ").expect("a step 1") + 1;
    let (preamble, walkthrough) = raw.split_at(first);
    let background: Vec<&str> = preamble
        .lines()
        .filter_map(|l| l.strip_suffix(" &"))
        .collect();
    assert_eq!(background.len(), 2, "demo-upstream and serve: {preamble}");
    let foreground: String = preamble
        .lines()
        .filter(|l| !l.ends_with(" &"))
        .map(|l| format!("{l}\n"))
        .collect();
    let run = sh(dir.path(), &foreground, &[]).await;
    assert_eq!(run.code, 0, "{foreground}: {run:?}");
    assert!(config.exists(), "{foreground}");
    let mut started = Vec::new();
    for line in &background {
        assert!(line.starts_with("idemgate "), "{line}");
        let bin = Path::new(env!("CARGO_BIN_EXE_idemgate"));
        let child = command()
            .args(line["idemgate ".len()..].split_whitespace())
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{} {line}: {e}", bin.display()));
        started.push(Killed(child));
    }
    for addr in [upstream, proxy] {
        wait_for("the walkthrough's processes to listen", || async move {
            tokio::net::TcpStream::connect(addr).await.ok()
        })
        .await;
    }

    let curl_home = dir.path().join("curl");
    std::fs::create_dir(&curl_home).unwrap();
    std::fs::write(curl_home.join(".curlrc"), "max-time = 30\n").unwrap();
    let steps = steps(walkthrough);
    let numbers: Vec<u32> = steps.iter().map(|s| s.number).collect();
    assert!(
        steps.len() >= 6 && numbers == (1..=steps.len() as u32).collect::<Vec<_>>(),
        "steps 1, 2, ...: {numbers:?}"
    );
    let mut checked = 0;
    for step in &steps {
        let output = run_shell(&step.shell, &curl_home);
        if !step.shell.contains("curl -i") {
            // "The API ran twice (ord_1, ord_2), not five times".
            let named: Vec<&str> = step
                .comment
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("ord_"))
                .collect();
            assert!(!named.is_empty(), "step {}: {}", step.number, step.comment);
            let body: serde_json::Value = serde_json::from_str(output.trim())
                .unwrap_or_else(|e| panic!("step {}: {e}: {output}", step.number));
            assert_eq!(body["count"], named.len(), "step {}: {output}", step.number);
            let ids: Vec<&str> = body["orders"]
                .as_array()
                .expect("orders")
                .iter()
                .filter_map(|o| o["id"].as_str())
                .collect();
            assert_eq!(ids, named, "step {}: {output}", step.number);
            checked += 1;
            continue;
        }
        let (expected, claimed) = expectations(&step.comment);
        assert!(claimed.is_empty(), "step {}: {claimed:?}", step.number);
        let got = answers(&output);
        assert_eq!(
            got.len(),
            expected.len(),
            "step {}: {}\n{output}",
            step.number,
            step.comment
        );
        for (want, answer) in expected.iter().zip(&got) {
            let at = format!("step {}: {}\n{output}", step.number, step.comment);
            assert_eq!(answer.status, want.status, "{at}");
            for (name, value) in &want.headers {
                assert_eq!(answer.header(name), Some(value.as_str()), "{name}: {at}");
                checked += 1;
            }
            for order in &want.orders {
                let body: serde_json::Value = serde_json::from_str(answer.body.trim())
                    .unwrap_or_else(|e| panic!("{e}: {at}"));
                assert_eq!(body["id"], order.as_str(), "{at}");
                checked += 1;
            }
            checked += 1;
        }
    }
    assert!(checked >= 9, "only {checked} checks from the comments");
    drop(started);
}

// ===== consumers.md =====

/// A block's shell commands as `sh` would read them: continuation lines
/// joined, a here-document (`<<'EOF'` to `EOF`) kept whole with its
/// command, each with its `# comment` apart; comment-only lines dropped.
fn shell_commands(raw: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut lines = raw.lines();
    let mut text = String::new();
    let mut comment = String::new();
    while let Some(line) = lines.next() {
        if let Some(at) = line.find("<<'") {
            let tag = line[at + 3..]
                .split('\'')
                .next()
                .expect("a tag")
                .to_string();
            let mut doc = vec![line.to_string()];
            for l in lines.by_ref() {
                doc.push(l.to_string());
                if l == tag {
                    break;
                }
            }
            out.push((doc.join("\n"), String::new()));
            continue;
        }
        let (code, said) = split_comment(line);
        if !said.is_empty() {
            comment = said.to_string();
        }
        match code.strip_suffix('\\') {
            Some(head) => {
                text.push_str(head.trim());
                text.push(' ');
            }
            None => {
                text.push_str(code.trim());
                if !text.is_empty() {
                    out.push((std::mem::take(&mut text), std::mem::take(&mut comment)));
                }
                comment.clear();
            }
        }
    }
    out
}

/// consumers.md's walkthrough, against a private RabbitMQ node with the
/// management plugin (never the shared broker's): the block's variables
/// point `rabbitmqadmin` and idemgate at the node the way a user whose
/// broker is elsewhere would set them, its addresses are moved to free
/// ports, and each command is held to its comment: the message published
/// twice is one order, one duplicate suppressed, the broker up, and
/// `keys show --consumer` finds its completed record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_md_walkthrough_runs_a_duplicated_message_once() {
    use crate::support::brokers::{rabbitmq_counts_on, PrivateRabbit};
    let page = std::fs::read_to_string(book().join("consumers.md")).expect("read consumers.md");
    let prose = page.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        prose.contains("`rabbitmq-plugins enable rabbitmq_management`"),
        "the walkthrough tells a user to enable the management plugin rabbitmqadmin needs"
    );
    let block = block("consumers.md", "rabbitmqadmin");
    let rabbit = PrivateRabbit::start_management().await;
    let management = rabbit.management_port.expect("management").to_string();
    let amqp = rabbit.port.to_string();
    let env = [
        ("RABBITMQ_HOST", "127.0.0.1"),
        ("RABBITMQ_PORT", amqp.as_str()),
        ("RABBITMQ_MANAGEMENT_PORT", management.as_str()),
    ];
    let dir = tempfile::tempdir().unwrap();
    let (proxy, admin, upstream) = (free_port(), free_port(), free_port());
    let mut raw = block.raw.clone();
    for (port, to) in [("8080", proxy), ("9090", admin), ("3000", upstream)] {
        for host in ["127.0.0.1", "localhost"] {
            raw = raw.replace(&format!("{host}:{port}"), &to.to_string());
        }
    }
    let bin = Path::new(env!("CARGO_BIN_EXE_idemgate"));
    let path = format!(
        "{}:{}",
        bin.parent().expect("the binary's directory").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // The variable lines (and the export) run before every later command,
    // as in the user's one shell.
    let mut prelude = String::new();
    let mut started = Vec::new();
    let mut checked = Vec::new();
    for (text, comment) in shell_commands(&raw) {
        let at = format!("consumers.md: {text}");
        if text.starts_with("RABBITMQ_") {
            // Its default is the ordinary local broker's.
            let default = match text.split_once('=').expect("NAME=...").0 {
                "RABBITMQ_HOST" => "127.0.0.1",
                "RABBITMQ_PORT" => "5672",
                "RABBITMQ_MANAGEMENT_PORT" => "15672",
                other => panic!("{at}: an unknown variable {other}"),
            };
            assert!(text.ends_with(&format!(":-{default}}}")), "{at}");
            prelude.push_str(&format!("{text}\n"));
            continue;
        }
        if text.starts_with("export ") {
            prelude.push_str(&format!("{text}\n"));
            continue;
        }
        let script = format!("{prelude}{text}");
        if let Some(command) = text.strip_suffix(" &") {
            // In the background: started here, stopped at the end.
            let mut sh = std::process::Command::new("sh");
            sh.arg("-c")
                .arg(format!("{prelude}exec {command}"))
                .current_dir(dir.path())
                .env("PATH", &path)
                .envs(env)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(
                    std::fs::File::create(dir.path().join(format!("bg-{}.log", started.len())))
                        .unwrap(),
                );
            for (k, _) in std::env::vars() {
                if k.starts_with("IDEMGATE_") {
                    sh.env_remove(k);
                }
            }
            started.push(Killed(sh.spawn().unwrap_or_else(|e| panic!("{at}: {e}"))));
            let listens = if command.contains("demo-upstream") {
                upstream
            } else {
                admin
            };
            wait_for("the walkthrough's process to listen", || async move {
                tokio::net::TcpStream::connect(listens).await.ok()
            })
            .await;
            continue;
        }
        // A command whose comment says what it prints is looked at again
        // (bounded) until it does: the consumer takes its messages soon
        // after they are published, not at once.
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let run = sh(dir.path(), &script, &env).await;
            let verdict: Result<(), String> = if text.starts_with("rabbitmqadmin") {
                let want = if text.contains(" publish ") {
                    "Message published"
                } else {
                    "queue declared"
                };
                (run.code == 0 && run.stdout.contains(want))
                    .then_some(())
                    .ok_or(format!("{want}: {run:?}"))
            } else if text.starts_with("cat > consumer.toml") {
                let written = std::fs::read_to_string(dir.path().join("consumer.toml"));
                (run.code == 0 && written.is_ok_and(|t| t.contains("[[consumer]]")))
                    .then_some(())
                    .ok_or(format!("{run:?}"))
            } else if text.starts_with("sleep ") {
                (run.code == 0).then_some(()).ok_or(format!("{run:?}"))
            } else if text.ends_with("/orders") {
                assert_eq!(comment, "one order", "{at}");
                let body: serde_json::Value =
                    serde_json::from_str(run.stdout.trim()).unwrap_or_default();
                (body["count"] == 1)
                    .then_some(())
                    .ok_or(format!("one order: {run:?}"))
            } else if text.contains("/metrics | grep duplicates_suppressed") {
                assert_eq!(comment, "1", "{at}");
                let value = run
                    .stdout
                    .lines()
                    .find(|l| l.starts_with("idemgate_consumer_duplicates_suppressed_total{"))
                    .and_then(|l| l.rsplit(' ').next())
                    .map(str::to_string);
                (value.as_deref() == Some("1"))
                    .then_some(())
                    .ok_or(format!("{value:?}: {run:?}"))
            } else if text.ends_with("/healthz") {
                assert_eq!(comment, "ok, consumer orders: broker up", "{at}");
                (run.stdout == "ok\nconsumer orders: broker up\n")
                    .then_some(())
                    .ok_or(format!("{run:?}"))
            } else if text.starts_with("idemgate keys show ") {
                assert_eq!(comment, "state completed, status 201", "{at}");
                let ok = run.code == 0
                    && shown(&run.stdout, "state") == Some("completed")
                    && shown(&run.stdout, "status") == Some("201");
                ok.then_some(()).ok_or(format!("{run:?}"))
            } else {
                panic!("{at}: not run here: add it");
            };
            match verdict {
                Ok(()) => break,
                Err(why) if tokio::time::Instant::now() >= deadline => {
                    panic!("{at}: not as its comment says: {why}")
                }
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(250)).await,
            }
        }
        checked.push(text);
    }
    assert_eq!(
        checked.len(),
        10,
        "every command of the walkthrough ran: {checked:?}"
    );
    assert_eq!(started.len(), 2, "demo-upstream and serve");
    // Nothing left: both copies acked, none dead-lettered, still one order.
    let node = rabbit.node.clone();
    let counts = tokio::task::spawn_blocking(move || {
        (
            rabbitmq_counts_on(&node, "orders"),
            rabbitmq_counts_on(&node, "orders.dlq"),
        )
    })
    .await
    .unwrap();
    assert_eq!(
        counts,
        ((0, 0), (0, 0)),
        "orders, orders.dlq: (ready, unacked)"
    );
    let orders = sh(dir.path(), &format!("curl -s {upstream}/orders"), &[]).await;
    let body: serde_json::Value = serde_json::from_str(orders.stdout.trim()).unwrap_or_default();
    assert_eq!(body["count"], 1, "{orders:?}");
    drop(started);
}

#[test]
fn a_block_is_read_as_sh_reads_it() {
    let raw = "A=${A:-1}   # the default\n# only a comment\nrun x \\\n  y   # joined\ncat > f <<'EOF'\n[s]\n# not a comment\nEOF\nlast\n";
    let cmds = shell_commands(raw);
    let want = [
        ("A=${A:-1}", "the default"),
        ("run x y", "joined"),
        ("cat > f <<'EOF'\n[s]\n# not a comment\nEOF", ""),
        ("last", ""),
    ];
    let got: Vec<(&str, &str)> = cmds.iter().map(|(t, c)| (t.as_str(), c.as_str())).collect();
    assert_eq!(got, want);
}
