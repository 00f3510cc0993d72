//! The README's "Walkthrough with curl" works as written: its `sh` block
//! is read from README.md (never copied here), each numbered step's
//! commands run with the real `curl` against `idemgate demo`, and every
//! answer is held to what the step's comment says: the status codes in
//! order, the headers it names (`Idempotency-Status: created`,
//! `Retry-After: 1`, ...; `201 (created)` is an `Idempotency-Status`), the
//! order ids. Editing a command or a comment so that they disagree with the
//! product fails here. The book's `sh` blocks: tests/it/book_commands.rs.

use crate::support::process::command;
use crate::support::{free_port, wait_for};
use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Child, Stdio};

/// The demo process, killed on drop.
struct Demo(Child);

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One numbered step of the walkthrough: its comment (joined into one
/// line) and its shell text (continuation lines kept, for `sh`).
#[derive(Debug)]
pub(super) struct Step {
    pub(super) number: u32,
    pub(super) comment: String,
    pub(super) shell: String,
}

/// What a step's comment says one answer is.
#[derive(Debug, Default)]
pub(super) struct Expect {
    pub(super) status: u16,
    pub(super) headers: Vec<(String, String)>,
    /// Order ids (`ord_1`) its body holds.
    pub(super) orders: Vec<String>,
}

/// One response as `curl -i` printed it.
#[derive(Debug)]
pub(super) struct Answer {
    pub(super) status: u16,
    pub(super) headers: Vec<(String, String)>,
    pub(super) body: String,
}

impl Answer {
    pub(super) fn header(&self, name: &str) -> Option<&str> {
        let mut found = self
            .headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name));
        found.next().map(|(_, v)| v.as_str())
    }
}

/// The `sh` block of README.md's section `heading`.
fn readme_block(heading: &str) -> String {
    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let text = std::fs::read_to_string(&readme).expect("read README.md");
    let start = text
        .find(&format!("\n## {heading}\n"))
        .unwrap_or_else(|| panic!("README.md has no section {heading:?}"));
    let section = &text[start + 1..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
    let open = section
        .find("```sh\n")
        .unwrap_or_else(|| panic!("no ```sh block in README.md's {heading:?}"));
    let block = &section[open + 6..];
    block[..block.find("```").expect("an unclosed ```sh block")].to_string()
}

/// The numbered steps: a comment line `# N. ...` starts one; the comment
/// lines after it continue its comment, the other lines are its commands.
pub(super) fn steps(block: &str) -> Vec<Step> {
    let mut steps: Vec<Step> = Vec::new();
    for line in block.lines() {
        let trimmed = line.trim();
        if let Some(comment) = trimmed.strip_prefix('#') {
            let comment = comment.trim();
            let number = comment
                .split_once(". ")
                .and_then(|(n, _)| n.parse::<u32>().ok());
            match number {
                Some(number) => steps.push(Step {
                    number,
                    comment: comment.to_string(),
                    shell: String::new(),
                }),
                None => {
                    let step = steps.last_mut().expect("a comment before step 1");
                    step.comment.push(' ');
                    step.comment.push_str(comment);
                }
            }
        } else if !trimmed.is_empty() {
            let step = steps.last_mut().expect("a command before step 1");
            step.shell.push_str(line);
            step.shell.push('\n');
        }
    }
    steps
}

/// The answers a comment describes, in order: each status code (a
/// three-digit number from 100 to 599) starts one; a `Name-With-Dash:
/// value`, an order id `ord_N`, or a `(word)` right after the status
/// (its `Idempotency-Status`) belong to the answer before them. What comes
/// before any status is returned apart: a claim about the step's commands
/// without one (step 6: "a key sent here would be answered with ...").
pub(super) fn expectations(comment: &str) -> (Vec<Expect>, Vec<(String, String)>) {
    let bytes = comment.as_bytes();
    let word_char = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'-';
    let mut answers: Vec<Expect> = Vec::new();
    let mut before: Vec<(String, String)> = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if (i > 0 && word_char(bytes[i - 1])) || !word_char(bytes[i]) {
            i += 1;
            continue;
        }
        // A word starts at i.
        let end = (i..bytes.len())
            .find(|&j| !word_char(bytes[j]))
            .unwrap_or(bytes.len());
        let word = &comment[i..end];
        let rest = &comment[end..];
        if word.len() == 3
            && word.bytes().all(|b| b.is_ascii_digit())
            && (b'1'..=b'5').contains(&bytes[i])
        {
            let mut expect = Expect {
                status: word.parse().unwrap(),
                ..Expect::default()
            };
            // "201 (created)": its Idempotency-Status.
            if let Some(inner) = rest.strip_prefix(" (").and_then(|r| r.split_once(')')) {
                if !inner.0.is_empty()
                    && inner.0.bytes().all(|b| b.is_ascii_lowercase() || b == b'-')
                {
                    expect
                        .headers
                        .push(("Idempotency-Status".into(), inner.0.into()));
                }
            }
            answers.push(expect);
        } else if word.starts_with("ord_") && word[4..].bytes().all(|b| b.is_ascii_digit()) {
            answers
                .last_mut()
                .expect("an order id before any status")
                .orders
                .push(word.into());
        } else if word.contains('-')
            && word.as_bytes()[0].is_ascii_uppercase()
            && rest.starts_with(": ")
        {
            let value = &rest[2..];
            let value = &value[..value
                .bytes()
                .position(|b| !word_char(b))
                .unwrap_or(value.len())];
            let value = value.trim_end_matches('-');
            let header = (word.to_string(), value.to_string());
            match answers.last_mut() {
                Some(a) => a.headers.push(header),
                None => before.push(header),
            }
        }
        i = end;
    }
    (answers, before)
}

/// Runs `shell` with `sh` (each step's text as the README has it), curl
/// reading no user's `.curlrc` but one with a time limit; returns stdout.
pub(super) fn run_shell(shell: &str, curl_home: &Path) -> String {
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(shell)
        .env("CURL_HOME", curl_home)
        .stdin(Stdio::null())
        .output()
        .expect("run sh");
    assert!(
        out.status.success(),
        "{shell}\nexited {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// The responses `curl -i` printed, in order (a background `curl -s`'s
/// body lands in the body before it: only heads are compared there).
pub(super) fn answers(output: &str) -> Vec<Answer> {
    let mut answers: Vec<Answer> = Vec::new();
    let mut in_head = false;
    for line in output.split('\n') {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if let Some(status) = line.strip_prefix("HTTP/").and_then(|l| l.split(' ').nth(1)) {
            answers.push(Answer {
                status: status.parse().expect("a status code"),
                headers: Vec::new(),
                body: String::new(),
            });
            in_head = true;
            continue;
        }
        let Some(answer) = answers.last_mut() else {
            continue;
        };
        if in_head {
            match line.split_once(": ") {
                Some((name, value)) => answer.headers.push((name.into(), value.into())),
                None => in_head = false,
            }
        } else {
            answer.body.push_str(line);
            answer.body.push('\n');
        }
    }
    answers
}

/// The values of `Idempotency-Key: ...` the commands send.
fn keys_sent(shell: &str) -> BTreeSet<String> {
    shell
        .split("Idempotency-Key: ")
        .skip(1)
        .map(|rest| rest[..rest.find('\'').unwrap_or(rest.len())].to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_curl_walkthrough_answers_as_its_comments_say() {
    let block = readme_block("Walkthrough with curl");
    let steps = steps(&block);
    let numbers: Vec<u32> = steps.iter().map(|s| s.number).collect();
    assert!(
        steps.len() >= 6 && numbers == (1..=steps.len() as u32).collect::<Vec<_>>(),
        "steps numbered 1, 2, ... (at least 6): {numbers:?}"
    );
    // The commands name the demo's default address, which the test moves
    // to a free port.
    const DEFAULT: &str = "localhost:8080";
    let help = crate::support::run_to_completion(&["demo", "--help"], &[]).await;
    assert!(
        help.stdout.contains("[default: 127.0.0.1:8080]"),
        "the README's commands use {DEFAULT}, but demo --help says:\n{}",
        help.stdout
    );

    let dir = tempfile::tempdir().unwrap();
    let curl_home = dir.path().join("curl");
    std::fs::create_dir(&curl_home).unwrap();
    std::fs::write(curl_home.join(".curlrc"), "max-time = 30\n").unwrap();
    let listen = free_port();
    let printed = dir.path().join("demo.out");
    let child = command()
        .args(["demo", "--listen", &listen.to_string(), "--db"])
        .arg(dir.path().join("demo.db"))
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&printed).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .expect("start idemgate demo");
    let _demo = Demo(child);
    wait_for("the demo to listen", || async {
        let text = std::fs::read_to_string(&printed).unwrap_or_default();
        text.contains("idemgate demo: proxy on").then_some(())
    })
    .await;

    let here = format!("127.0.0.1:{}", listen.port());
    let mut keys = BTreeSet::new();
    let mut checked = 0;
    for step in &steps {
        assert!(
            step.shell.contains(DEFAULT),
            "step {} runs nothing against the demo ({DEFAULT}):\n{}",
            step.number,
            step.shell
        );
        let shell = step.shell.replace(DEFAULT, &here);
        keys.extend(keys_sent(&shell));
        let (expected, claimed) = expectations(&step.comment);
        let output = run_shell(&shell, &curl_home);
        let got = answers(&output);
        let at = |i: usize| {
            format!(
                "step {}, answer {}: {}\n{output}",
                step.number,
                i + 1,
                step.comment
            )
        };
        assert_eq!(
            got.len(),
            expected.len(),
            "step {}: {} answers printed (curl -i), its comment describes {}: {}\n{output}",
            step.number,
            got.len(),
            expected.len(),
            step.comment
        );
        for (i, (want, answer)) in expected.iter().zip(&got).enumerate() {
            assert_eq!(answer.status, want.status, "{}", at(i));
            for (name, value) in &want.headers {
                assert_eq!(
                    answer.header(name),
                    Some(value.as_str()),
                    "{name}: {}",
                    at(i)
                );
                checked += 1;
            }
            for order in &want.orders {
                let body: serde_json::Value = serde_json::from_str(answer.body.trim())
                    .unwrap_or_else(|e| panic!("{e}: {}", at(i)));
                assert_eq!(body["id"], order.as_str(), "{}", at(i));
            }
            checked += 1;
        }
        if !claimed.is_empty() {
            // What the comment says a key sent to this step's requests
            // would get: send one.
            let with_key =
                shell.replace("curl -s ", "curl -s -i -H 'Idempotency-Key: doc-commands' ");
            let output = run_shell(&with_key, &curl_home);
            let got = answers(&output);
            assert!(
                !got.is_empty(),
                "step {}: {with_key}\n{output}",
                step.number
            );
            for answer in &got {
                for (name, value) in &claimed {
                    assert_eq!(
                        answer.header(name),
                        Some(value.as_str()),
                        "step {} with a key: {}\n{output}",
                        step.number,
                        step.comment
                    );
                    checked += 1;
                }
            }
        }
        // The last step counts the orders the API created: one per key.
        if step.number == numbers.len() as u32 {
            let body: serde_json::Value = serde_json::from_str(output.trim())
                .unwrap_or_else(|e| panic!("step {}: {e}:\n{output}", step.number));
            assert_eq!(
                body["count"],
                keys.len(),
                "one order per key sent ({keys:?}): {output}"
            );
            checked += 1;
        }
    }
    // Every step and answer above, and a claim of each kind, was checked.
    assert!(
        checked >= 15,
        "only {checked} checks from the README's comments"
    );
}

#[test]
fn a_comment_is_read_as_the_answers_it_describes() {
    let (answers, before) = expectations(
        "5. the first call gets the 503 (Idempotency-Status: released), the retry runs again and gets its 201 (created), order ord_2.",
    );
    assert!(before.is_empty());
    assert_eq!(answers.len(), 2);
    assert_eq!(answers[0].status, 503);
    assert_eq!(
        answers[0].headers,
        [("Idempotency-Status".into(), "released".into())]
    );
    assert_eq!(answers[1].status, 201);
    assert_eq!(
        answers[1].headers,
        [("Idempotency-Status".into(), "created".into())]
    );
    assert_eq!(answers[1].orders, ["ord_2"]);
    let (answers, _) =
        expectations("4. Retry: 409 + Retry-After: 1, Idempotency-Status: in-flight.");
    assert_eq!(
        answers[0].headers,
        [
            ("Retry-After".into(), "1".into()),
            ("Idempotency-Status".into(), "in-flight".into())
        ]
    );
    let (answers, before) =
        expectations("6. Count (A key here gets Idempotency-Status: ignored: not protected.)");
    assert!(answers.is_empty());
    assert_eq!(before, [("Idempotency-Status".into(), "ignored".into())]);
}
