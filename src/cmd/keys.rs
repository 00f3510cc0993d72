//! `idemgate keys`: read and repair records behind a running proxy.
//!
//! Operators name a key the way clients send it, plus the scope: the scope
//! header's value (hashed here exactly as the proxy hashes it), a scope hash
//! as printed by `show` or logged on the access log line (`scope`), a
//! route's consumer name, a client certificate's
//! PEM file (`scope = { client_cert = true }`), or `--anonymous` for
//! requests without the header.

use crate::clock::Clock;
use crate::config::{Config, RouteConfig, Secret};
use crate::idempotency::{IdempotencyKey, RecordKey, Scope};
use crate::net::tls_server::ClientCert;
use crate::store::{
    rotate, Record, RecordState, Resolution, Store, StoreError, UnixMillis, Verdict,
    RESOLVED_STATUS,
};
use anyhow::Context;
use http::HeaderName;
use std::fmt::{self, Write};
use std::str::FromStr;
use std::time::{Duration, UNIX_EPOCH};

/// How the operator named the scope.
#[derive(Clone, Debug)]
pub enum ScopeArg {
    /// The value of a route's only (or first) scope header.
    HeaderValue(String),
    /// The scope headers a client sent; `route` picks whose order applies.
    Headers {
        sent: Vec<ScopeHeader>,
        route: Option<usize>,
    },
    Hash(String),
    /// A route's fixed consumer name (`scope = { value }`).
    Value(String),
    /// A `[[consumer]]`'s name: its messages' keys.
    Consumer(String),
    /// The PEM file of a client's certificate (`scope = { client_cert }`).
    ClientCert(std::path::PathBuf),
    Anonymous,
}

impl ScopeArg {
    /// The scope as the proxy running on `config` derives it (with its
    /// `IDEMGATE_SCOPE_SECRET`, and its routes' scope headers).
    pub fn resolve(&self, config: &Config) -> Result<Scope, String> {
        let secret = config.scope_secret.as_ref().map(Secret::expose);
        match self {
            ScopeArg::HeaderValue(v) => {
                one_scope_header(config)?;
                Ok(Scope::derive(Some(v.as_bytes()), secret))
            }
            ScopeArg::Headers { sent, route } => scope_of_headers(sent, *route, config),
            ScopeArg::Anonymous => Ok(Scope::derive(None, secret)),
            ScopeArg::Value(v) => Ok(Scope::of_value(v, secret)),
            ScopeArg::Consumer(name) => {
                let consumers = &config.restart.consumers;
                if !consumers.iter().any(|c| &*c.name == name) {
                    let names: Vec<&str> = consumers.iter().map(|c| &*c.name).collect();
                    return Err(format!(
                        "--consumer {name:?}: the config has no [[consumer]] of that name ({})",
                        match names.is_empty() {
                            true => "it has none".to_string(),
                            false => format!("it has: {}", names.join(", ")),
                        }
                    ));
                }
                Ok(Scope::of_value(name, secret))
            }
            ScopeArg::ClientCert(path) => {
                let cert = ClientCert::of_file("--client-cert", path).map_err(|e| e.to_string())?;
                Ok(Scope::of_client_cert(&cert.spki_sha256, secret))
            }
            ScopeArg::Hash(h) => {
                let bytes = hex::decode(h.trim()).ok();
                let hash = bytes.and_then(|b| <[u8; 32]>::try_from(b).ok());
                hash.map(Scope)
                    .ok_or_else(|| format!("--scope {h:?}: expected 64 hex characters"))
            }
        }
    }
}

/// `--scope-header-value` names the value of a route's one scope header.
/// On a config with a route that scopes keys by several, it cannot say
/// whose value it is, nor which others the request sent: the scope it
/// derives is another than that route's (the lookup would say "no
/// record"), so it is refused, saying how to name each header.
fn one_scope_header(config: &Config) -> Result<(), String> {
    let Some(r) = config
        .routes
        .iter()
        .find(|r| r.scope_value.is_none() && r.scope_headers.len() > 1)
    else {
        return Ok(());
    };
    let each: Vec<String> = r
        .scope_headers
        .iter()
        .map(|h| format!("--scope-header '{h}=...'"))
        .collect();
    Err(format!(
        "--scope-header-value gives one header's value, but route #{} {} scopes keys by {}: name each header the request sent as NAME=VALUE ({}), leaving out those it did not send",
        r.index,
        r.path,
        r.scope_label(),
        each.join(" ")
    ))
}

/// `--key-id ID`: the `key.id` of the request's access log line. The key
/// and scope named must give it; if they do not, the scope is the wrong
/// one (a lookup would say "no record" of a record that exists), and the
/// scopes that need no credential are tried to say which one it is.
pub fn check_key_id(
    key: &str,
    named: &RecordKey,
    want: &str,
    config: &Config,
) -> Result<(), String> {
    let want = want.trim().to_ascii_lowercase();
    if want.len() != 16 || !want.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "--key-id {want:?}: expected the 16 hex characters of a log line's key.id"
        ));
    }
    if named.log_id() == want {
        return Ok(());
    }
    let secret = config.scope_secret.as_ref().map(Secret::expose);
    let parsed = IdempotencyKey::parse(key.as_bytes()).map_err(|e| format!("invalid key: {e}"))?;
    let mut open: Vec<(String, Scope)> = vec![("--anonymous".into(), Scope::derive(None, secret))];
    for r in config.routes.iter() {
        if let Some(v) = &r.scope_value {
            open.push((format!("--scope-value '{v}'"), Scope::of_value(v, secret)));
        }
    }
    let hint = match open
        .iter()
        .find(|(_, scope)| RecordKey::new(*scope, &parsed).log_id() == want)
    {
        Some((arg, _)) => format!("it is this key with {arg}"),
        None => "nor is it this key with --anonymous or a route's scope value: check the key, the header values (each one the request sent), and IDEMGATE_SCOPE_SECRET".to_string(),
    };
    Err(format!(
        "key id {want} is not this key in the scope named (that is key id {}): {hint}",
        named.log_id()
    ))
}

/// One `--scope-header NAME=VALUE`.
#[derive(Clone)]
pub struct ScopeHeader {
    pub name: HeaderName,
    pub value: String,
}

impl FromStr for ScopeHeader {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        // A header name holds no '=', so the first one ends it.
        let (name, value) = s
            .split_once('=')
            .ok_or_else(|| "expected NAME=VALUE, e.g. Stripe-Account=acct_1".to_string())?;
        let name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("{name:?} is not a header name"))?;
        Ok(Self {
            name,
            value: value.to_string(),
        })
    }
}

/// The value is a credential: never printed.
impl fmt::Debug for ScopeHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ScopeHeader({}=..)", self.name)
    }
}

/// The scope of the headers a client `sent`, in the order of the routes
/// that list them all (or of route #`route`). Routes that would derive
/// different scopes from them are an error asking for `--route`.
fn scope_of_headers(
    sent: &[ScopeHeader],
    route: Option<usize>,
    config: &Config,
) -> Result<Scope, String> {
    let secret = config.scope_secret.as_ref().map(Secret::expose);
    let mut names: Vec<&str> = Vec::new();
    for h in sent {
        if !names.contains(&h.name.as_str()) {
            names.push(h.name.as_str());
        }
    }
    let names = names.join(", ");
    let fits = |r: &RouteConfig| sent.iter().all(|h| r.scope_headers.contains(&h.name));
    let candidates: Vec<&RouteConfig> = match route {
        Some(n) => {
            let r = config.routes.iter().find(|r| r.index == n).ok_or_else(|| {
                format!("--route {n}: the config has no route #{n} (check-config lists them)")
            })?;
            if !fits(r) {
                return Err(format!(
                    "route #{n} scopes keys by {}, not by all of {names}",
                    r.scope_label()
                ));
            }
            vec![r.as_ref()]
        }
        None => config
            .routes
            .iter()
            .map(|r| r.as_ref())
            .filter(|r| fits(r))
            .collect(),
    };
    let mut found: Vec<(Scope, &RouteConfig)> = Vec::new();
    for r in candidates {
        let values: Vec<Vec<&[u8]>> = r
            .scope_headers
            .iter()
            .map(|name| {
                sent.iter()
                    .filter(|h| h.name == *name)
                    .map(|h| h.value.as_bytes())
                    .collect()
            })
            .collect();
        let scope = Scope::of_values(&values, secret);
        if !found.iter().any(|(s, _)| *s == scope) {
            found.push((scope, r));
        }
    }
    match found.as_slice() {
        [(scope, _)] => Ok(*scope),
        [] => Err(format!(
            "no route scopes keys by all of {names} (check-config prints each route's scope=)"
        )),
        several => Err(format!(
            "routes {} derive different scopes from {names}: add --route N",
            several
                .iter()
                .map(|(_, r)| format!("#{} (scope={})", r.index, r.scope_label()))
                .collect::<Vec<_>>()
                .join(" and ")
        )),
    }
}

/// The record key for `key` in `scope`, on the proxy that runs `config`.
pub fn record_key(key: &str, scope: &ScopeArg, config: &Config) -> Result<RecordKey, String> {
    let key = IdempotencyKey::parse(key.as_bytes()).map_err(|e| format!("invalid key: {e}"))?;
    Ok(RecordKey::new(scope.resolve(config)?, &key))
}

/// Human-readable description of a record (or of its absence).
pub async fn show(store: &dyn Store, key: &RecordKey, clock: &Clock) -> Result<String, StoreError> {
    let now = clock.now_millis();
    let Some(record) = store.get(key).await? else {
        return Ok(absent(key));
    };
    let resolution = store.resolution(key).await?;
    Ok(describe(key, &record, resolution.as_ref(), now))
}

fn absent(key: &RecordKey) -> String {
    format!(
        "no record for key id {} in scope {}\n",
        key.log_id(),
        key.scope.to_hex()
    )
}

/// A record whose ttl ran out: as good as absent (the sweeper has not
/// deleted it yet), so there is nothing left to settle.
fn expired(key: &RecordKey) -> String {
    format!(
        "no live record for key id {} in scope {} (it expired: the next request with this key runs as new)\n",
        key.log_id(),
        key.scope.to_hex()
    )
}

/// `resolution` is what an operator's `keys resolve --applied` kept, if any.
pub fn describe(
    key: &RecordKey,
    r: &Record,
    resolution: Option<&Resolution>,
    now: UnixMillis,
) -> String {
    let mut out = String::new();
    let expired = r.expires_at <= now;
    let _ = writeln!(out, "key id       {}", key.log_id());
    let _ = writeln!(out, "scope        {}", key.scope.to_hex());
    let _ = writeln!(
        out,
        "state        {}{}",
        r.state.as_str(),
        if expired {
            " (expired: the next request with this key runs as new)"
        } else {
            ""
        }
    );
    let _ = writeln!(out, "fingerprint  {}", r.fingerprint.to_hex());
    let _ = writeln!(out, "created      {}", time(r.created_at));
    // Only this record's own request: the key is already the scope's.
    match &r.first_use {
        Some(first) => {
            let _ = writeln!(out, "first use    {} {}", first.method, first.path);
        }
        None => {
            let _ = writeln!(out, "first use    not kept (claimed by an earlier version)");
        }
    }
    let _ = writeln!(
        out,
        "expires      {} ({})",
        time(r.expires_at),
        relative(r.expires_at, now)
    );
    match &r.state {
        RecordState::InFlight { locked_until } => {
            let _ = writeln!(
                out,
                "lease until  {} ({}{})",
                time(*locked_until),
                relative(*locked_until, now),
                if *locked_until <= now {
                    ", abandoned: the next retry takes it over"
                } else {
                    ""
                }
            );
        }
        RecordState::Completed(resp) => {
            let _ = writeln!(out, "status       {}", resp.status);
            let _ = writeln!(out, "body         {} bytes", resp.body.len());
            let _ = writeln!(out, "headers");
            for (name, value) in &resp.headers {
                let _ = writeln!(out, "  {name}: {}", String::from_utf8_lossy(value));
            }
        }
        RecordState::Unstored { status } => match resolution {
            // Resolved as applied: no answer came, so there is no status.
            Some(res) => {
                let _ = writeln!(
                    out,
                    "status       none (executed, response not stored; retries get 410)"
                );
                let _ = writeln!(
                    out,
                    "resolved     applied at {} ({}): {}",
                    time(res.at),
                    relative(res.at, now),
                    res.reason
                );
            }
            None => {
                let _ = writeln!(
                    out,
                    "status       {status} (response was too large to store; retries get 410)"
                );
            }
        },
        RecordState::Unknown => {
            let _ = writeln!(
                out,
                "outcome      unknown: sent upstream, never answered; retries get 424 until this key is resolved (keys resolve) or deleted"
            );
        }
    }
    out
}

/// The longest `--reason` `keys resolve` keeps.
pub const MAX_REASON_CHARS: usize = 500;

/// A `--reason`: what the operator found out, kept with an applied record
/// and logged, so one line of printable text, and bounded.
pub fn parse_reason(s: &str) -> Result<String, String> {
    let reason = s.trim();
    if reason.is_empty() {
        return Err("say why (e.g. \"the ledger shows payment 81 once\")".into());
    }
    if reason.chars().count() > MAX_REASON_CHARS {
        return Err(format!("at most {MAX_REASON_CHARS} characters"));
    }
    if reason.chars().any(char::is_control) {
        return Err("one line of text, without control characters".into());
    }
    Ok(reason.to_string())
}

/// Why `resolve` left a record that is not outcome unknown alone.
fn not_unknown(key: &RecordKey, r: &Record, now: UnixMillis) -> String {
    let state = match &r.state {
        RecordState::InFlight { locked_until } if *locked_until > now => format!(
            "in flight: its lease is live until {} (a request is running); wait for it to end",
            time(*locked_until)
        ),
        RecordState::InFlight { .. } => {
            "in flight, lease expired: the next retry takes it over".to_string()
        }
        RecordState::Completed(resp) => {
            format!("completed with status {}: retries replay it", resp.status)
        }
        RecordState::Unstored {
            status: RESOLVED_STATUS,
        } => "already resolved as applied: retries get 410".to_string(),
        RecordState::Unstored { status } => {
            format!("completed with status {status}, response not stored: retries get 410")
        }
        // Resolved or deleted by someone else in between.
        RecordState::Unknown => {
            "outcome unknown, but it changed while resolving; run it again".to_string()
        }
    };
    format!(
        "key id {} is not outcome-unknown (state {}): it is {state}; resolve settles only unknown outcomes (keys delete removes a record in any state)",
        key.log_id(),
        r.state.as_str()
    )
}

fn time(ms: UnixMillis) -> String {
    let t = UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

fn relative(ms: UnixMillis, now: UnixMillis) -> String {
    let d = Duration::from_millis((ms - now).unsigned_abs() / 1000 * 1000);
    let h = humantime::format_duration(d).to_string();
    if ms >= now {
        format!("in {h}")
    } else {
        format!("{h} ago")
    }
}

/// Deletes expired records in batches until none are left; returns the count.
pub async fn purge_expired(
    store: &dyn Store,
    batch: u32,
    clock: &Clock,
) -> Result<u64, StoreError> {
    let mut total = 0;
    loop {
        let n = store.sweep(clock.now_millis(), batch).await?;
        total += n;
        if n < u64::from(batch) {
            return Ok(total);
        }
    }
}

/// What `idemgate keys` was asked to do.
pub enum KeysAction {
    Show(RecordKey),
    Delete(RecordKey),
    /// `reason` is logged for either verdict (an applied record keeps it too).
    Resolve {
        key: RecordKey,
        verdict: Verdict,
        reason: String,
    },
    PurgeExpired,
    Reencrypt {
        batch: u32,
        after: Option<RecordKey>,
    },
}

/// The exit status of `keys show` for a key with no record, so scripts can
/// tell "absent" (3) from "found" (0) and from a failure (1) or a bad
/// command line or config (64).
pub const EXIT_NO_RECORD: u8 = 3;

/// How a `keys` command that ran ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeysOutcome {
    Done,
    /// `show` found no record ([`EXIT_NO_RECORD`]).
    NoRecord,
}

/// Which scope a key belongs to.
#[derive(Debug, clap::Args)]
pub struct ScopeArgs {
    #[command(flatten)]
    pub named: ScopeNamed,
    /// With --scope-header: the route whose scope headers give their order
    /// (#N as check-config lists it); needed only when routes that list
    /// these headers would derive different scopes from them.
    #[arg(long, value_name = "N", conflicts_with_all = ["scope_header_value", "scope", "scope_value", "client_cert", "consumer", "anonymous"])]
    pub route: Option<usize>,
    /// The `key.id` of the request's access log line: refuse a key and
    /// scope that do not give it (rather than say "no record").
    #[arg(long, value_name = "ID")]
    pub key_id: Option<String>,
}

/// The scope, named one way (exactly one).
#[derive(Debug, clap::Args)]
#[group(required = true, multiple = false)]
pub struct ScopeNamed {
    /// The scope header's value as the client sent it (e.g. "Bearer abc"),
    /// on a config whose routes each have one scope header (refused where
    /// one has several: use --scope-header for each).
    #[arg(long)]
    pub scope_header_value: Option<String>,
    /// For a route with several scope headers: one header the client sent,
    /// as NAME=VALUE (e.g. Stripe-Account=acct_1). Repeat it for each
    /// header sent, and for each value of a repeated one; a header left
    /// out was absent. The config's routes give the order.
    #[arg(long, value_name = "NAME=VALUE")]
    pub scope_header: Vec<ScopeHeader>,
    /// The scope's hash: the access log line's `scope`, or what `keys
    /// show` printed (no credential needed).
    #[arg(long)]
    pub scope: Option<String>,
    /// A route's fixed consumer name (`scope = { value = "..." }`, or a
    /// preset's, e.g. "stripe:/hooks/stripe"; `check-config` shows it).
    #[arg(long, value_name = "VALUE")]
    pub scope_value: Option<String>,
    /// A route with `scope = { client_cert = true }`: the PEM file of the
    /// client's certificate (its public key names the scope).
    #[arg(long, value_name = "FILE")]
    pub client_cert: Option<std::path::PathBuf>,
    /// A `[[consumer]]`'s name: the key is a message's key (its message
    /// id, or where the consumer's `key` says).
    #[arg(long, value_name = "NAME")]
    pub consumer: Option<String>,
    /// Requests that carried none of the scope headers.
    #[arg(long)]
    pub anonymous: bool,
}

impl ScopeArgs {
    pub fn to_arg(&self) -> ScopeArg {
        let named = &self.named;
        if let Some(v) = &named.scope_value {
            return ScopeArg::Value(v.clone());
        }
        if let Some(name) = &named.consumer {
            return ScopeArg::Consumer(name.clone());
        }
        if let Some(path) = &named.client_cert {
            return ScopeArg::ClientCert(path.clone());
        }
        match (&named.scope_header_value, &named.scope) {
            (Some(v), _) => ScopeArg::HeaderValue(v.clone()),
            (None, Some(h)) => ScopeArg::Hash(h.clone()),
            (None, None) if !named.scope_header.is_empty() => ScopeArg::Headers {
                sent: named.scope_header.clone(),
                route: self.route,
            },
            (None, None) => ScopeArg::Anonymous,
        }
    }
}

#[derive(Debug, clap::Subcommand)]
pub enum KeysCommand {
    /// Show a key's record: state, fingerprint, status, headers, times, and the lease of one in flight.
    Show {
        #[command(flatten)]
        scope: ScopeArgs,
        /// The idempotency key as the client sent it.
        key: String,
    },
    /// Delete a key's record whatever its state (e.g. a key stuck in flight).
    Delete {
        #[command(flatten)]
        scope: ScopeArgs,
        key: String,
    },
    /// Settle an outcome-unknown key (on_ambiguous = "keep") once you know
    /// whether the upstream executed it: --not-applied lets the next retry
    /// run; --applied makes retries get 410 and never run.
    Resolve {
        #[command(flatten)]
        scope: ScopeArgs,
        #[command(flatten)]
        verdict: VerdictArgs,
        /// What you found out, kept with an --applied record and logged
        /// (one line, at most 500 characters).
        #[arg(long, value_parser = parse_reason)]
        reason: String,
        key: String,
    },
    /// Delete every expired record now.
    PurgeExpired,
    /// Rewrite every live stored response that is not sealed under the
    /// current (first) key of IDEMGATE_STORE_ENCRYPTION_KEYS, plaintext
    /// ones included, to that key, beside live traffic (a record changed
    /// meanwhile is left as it is). Run it, with the old key still listed,
    /// before removing a key.
    Reencrypt {
        /// Records per page (one scan, then one conditional write each).
        #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        batch: u32,
        /// Continue after this record: the `after` of a progress line.
        #[arg(long, value_name = "SCOPE:KEY", value_parser = parse_cursor)]
        after: Option<RecordKey>,
    },
}

/// A scan cursor as a progress line prints it: the scope digest and the
/// key digest, hex, joined by `:` (digests only, never a key).
pub fn cursor(key: &RecordKey) -> String {
    format!("{}:{}", hex::encode(key.scope.0), hex::encode(key.key))
}

/// [`cursor`] read back.
pub fn parse_cursor(s: &str) -> Result<RecordKey, String> {
    let digest = |part: &str| -> Option<[u8; 32]> { hex::decode(part).ok()?.try_into().ok() };
    let (scope, key) = s
        .split_once(':')
        .and_then(|(scope, key)| Some((digest(scope)?, digest(key)?)))
        .ok_or("expected SCOPE:KEY, two 64-digit hex digests as a progress line prints them")?;
    Ok(RecordKey {
        scope: Scope(scope),
        key,
    })
}

/// How many unreadable records `reencrypt` names one by one; the rest are counted.
const MAX_NAMED_UNREADABLE: usize = 100;

/// Whether the upstream executed the request (exactly one).
#[derive(Debug, clap::Args)]
#[group(required = true, multiple = false)]
pub struct VerdictArgs {
    /// It executed: keep the key as completed without a stored response.
    #[arg(long)]
    pub applied: bool,
    /// It did not execute: release the key.
    #[arg(long)]
    pub not_applied: bool,
}

impl VerdictArgs {
    pub fn verdict(&self, reason: &str) -> Verdict {
        if self.applied {
            Verdict::Applied {
                reason: reason.to_string(),
            }
        } else {
            Verdict::NotApplied
        }
    }
}

/// `idemgate keys COMMAND`, its exit code: 0, [`EXIT_NO_RECORD`], 1 for a
/// failure, 64 for a key or scope the command line got wrong.
pub fn command(cfg: Config, command: &KeysCommand) -> std::process::ExitCode {
    use std::process::ExitCode;
    let named = |scope: &ScopeArgs, key: &str| {
        let named = record_key(key, &scope.to_arg(), &cfg)?;
        match &scope.key_id {
            Some(id) => check_key_id(key, &named, id, &cfg).map(|()| named),
            None => Ok(named),
        }
    };
    let action = match command {
        KeysCommand::Show { scope, key } => named(scope, key).map(KeysAction::Show),
        KeysCommand::Delete { scope, key } => named(scope, key).map(KeysAction::Delete),
        KeysCommand::Resolve {
            scope,
            verdict,
            reason,
            key,
        } => {
            // The resolve is logged: the operator's record of it.
            crate::telemetry::init(cfg.restart.log.format, &cfg.restart.log.level);
            named(scope, key).map(|key| KeysAction::Resolve {
                key,
                verdict: verdict.verdict(reason),
                reason: reason.clone(),
            })
        }
        KeysCommand::PurgeExpired => Ok(KeysAction::PurgeExpired),
        KeysCommand::Reencrypt { batch, after } => Ok(KeysAction::Reencrypt {
            batch: *batch,
            after: *after,
        }),
    };
    let action = match action {
        Ok(a) => a,
        Err(e) => {
            eprintln!("idemgate keys: {e}");
            return ExitCode::from(super::EX_USAGE);
        }
    };
    match super::block_on(run(cfg, action)) {
        Ok(KeysOutcome::NoRecord) => ExitCode::from(EXIT_NO_RECORD),
        other => super::exit(other.map(|_| ())),
    }
}

/// `idemgate keys ...` against the configured store.
pub async fn run(config: Config, action: KeysAction) -> anyhow::Result<KeysOutcome> {
    let settings = &config.restart.store;
    if settings.backend == crate::config::Backend::Memory {
        anyhow::bail!(
            "the memory store lives inside the proxy process; nothing outside it can inspect its keys"
        );
    }
    // Opening creates a missing SQLite file: from `keys` that would be a
    // new, empty store (every key "absent", a delete that "worked"), never
    // the proxy's.
    let path = &settings.path;
    if settings.backend == crate::config::Backend::Sqlite && !path.exists() {
        anyhow::bail!(
            "no SQLite store at {} (store.path; a relative one is read from the config file's directory): keys never creates one; give --config the proxy's own config",
            path.display()
        );
    }
    if matches!(action, KeysAction::Reencrypt { .. }) && config.store_keys.is_none() {
        anyhow::bail!(
            "IDEMGATE_STORE_ENCRYPTION_KEYS is not set: reencrypt seals stored responses under its first key; set it as the proxy has it (the new key first, the old ones after)"
        );
    }
    let store = crate::store::open(&config)
        .await
        .context("cannot open the store")?;
    match action {
        KeysAction::Show(key) => {
            let Some(record) = store.get(&key).await? else {
                out!("{}", absent(&key));
                return Ok(KeysOutcome::NoRecord);
            };
            let resolution = store.resolution(&key).await?;
            let now = Clock::system().now_millis();
            out!("{}", describe(&key, &record, resolution.as_ref(), now));
        }
        KeysAction::Resolve {
            key,
            verdict,
            reason,
        } => {
            let now = Clock::system().now_millis();
            if !store.resolve(&key, &verdict, now).await? {
                let Some(record) = store.get(&key).await? else {
                    eprint!("idemgate keys: nothing to resolve: {}", absent(&key));
                    return Ok(KeysOutcome::NoRecord);
                };
                if record.expires_at <= now {
                    eprint!("idemgate keys: nothing to resolve: {}", expired(&key));
                    return Ok(KeysOutcome::NoRecord);
                }
                anyhow::bail!("{}", not_unknown(&key, &record, now));
            }
            // The keys command has no metrics registry (the proxy's is in
            // another process): this line, and an applied record's stored
            // resolution, are the account of it.
            tracing::info!(
                key.id = %key.log_id(),
                scope = %key.scope.to_hex(),
                decision = verdict.as_str(),
                reason = %reason,
                "outcome-unknown key resolved by an operator"
            );
            match verdict {
                Verdict::NotApplied => outln!(
                    "resolved key id {} as not applied: released, the next request with it executes",
                    key.log_id()
                ),
                Verdict::Applied { .. } => outln!(
                    "resolved key id {} as applied: retries get 410 and never execute",
                    key.log_id()
                ),
            }
        }
        KeysAction::Delete(key) => {
            // Deleting an absent key leaves what was asked for: exit 0.
            if store.delete(&key).await? {
                outln!("deleted key id {}", key.log_id());
            } else {
                outln!("no record for key id {}", key.log_id());
            }
        }
        KeysAction::PurgeExpired => {
            let n = purge_expired(store.as_ref(), settings.sweep_batch, &Clock::system()).await?;
            outln!("deleted {n} expired records");
        }
        KeysAction::Reencrypt { batch, after } => {
            let ring = config.store_keys.as_deref().expect("checked above");
            reencrypt(store.as_ref(), ring, batch, after).await?;
        }
    }
    Ok(KeysOutcome::Done)
}

/// `keys reencrypt`: the pass, a progress line per page, then what no key opens.
async fn reencrypt(
    store: &dyn Store,
    ring: &crate::idempotency::vault::KeyRing,
    batch: u32,
    after: Option<RecordKey>,
) -> anyhow::Result<()> {
    let clock = Clock::system();
    outln!(
        "reencrypt: sealing every live stored response under key id {:?}, {batch} per page{}",
        ring.current_id(),
        after
            .map(|a| format!(", after {}", cursor(&a)))
            .unwrap_or_default()
    );
    let progress = |t: &rotate::Tally| {
        outln!(
            "reencrypt: scanned {}, rewrote {}, already current {}, changed meanwhile {}, unreadable {}{}",
            t.scanned,
            t.rewritten,
            t.current,
            t.changed,
            t.unreadable.len(),
            t.cursor.map(|c| format!("; after {}", cursor(&c))).unwrap_or_default()
        )
    };
    let tally = match rotate::reencrypt(store, ring, batch, after, || clock.now_millis(), progress)
        .await
    {
        Ok(tally) => tally,
        Err(err) => {
            return Err(anyhow::Error::new(err).context(
                "reencrypt stopped (rerun it, or with --after the last progress line's cursor, to continue)",
            ))
        }
    };
    for (id, why) in tally.unreadable.iter().take(MAX_NAMED_UNREADABLE) {
        outln!("reencrypt: unreadable: key id {id}: {why}; left alone (it answers 410)");
    }
    if tally.unreadable.len() > MAX_NAMED_UNREADABLE {
        outln!(
            "reencrypt: unreadable: {} more not named",
            tally.unreadable.len() - MAX_NAMED_UNREADABLE
        );
    }
    let mut by_reason: std::collections::BTreeMap<String, usize> = Default::default();
    for (_, why) in &tally.unreadable {
        *by_reason.entry(why.to_string()).or_default() += 1;
    }
    for (why, n) in by_reason {
        outln!("reencrypt: {n} unreadable: {why}");
    }
    if tally.copies_left > 0 {
        outln!(
            "reencrypt: {} rewritten records kept their Redis copy under the old key (Redis did not answer the delete); they expire on their own, and once the old key is removed a proxy answers those keys from the store's copy and replaces them: nothing to do by hand",
            tally.copies_left
        );
    }
    outln!(
        "reencrypt: done: {} rewritten, {} already current, {} changed by live traffic meanwhile (a proxy with these keys seals new completions under {:?}), {} unreadable",
        tally.rewritten,
        tally.current,
        tally.changed,
        ring.current_id(),
        tally.unreadable.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::Fingerprint;
    use crate::store::memory::MemoryStore;
    use crate::store::{Claim, Completion, FirstUse, LeaseToken, Span, StoredResponse};
    use bytes::Bytes;

    #[tokio::test]
    async fn show_delete_and_purge_work_on_a_store() {
        let store = MemoryStore::new();
        let scope = ScopeArg::HeaderValue("Bearer t".into());
        let config = config(&[]);
        let key = record_key("\"k-1\"", &scope, &config).unwrap();
        assert_eq!(key, record_key("k-1", &scope, &config).unwrap());
        let token = LeaseToken::random();
        let clock = Clock::system();
        let now = clock.now_millis();
        store
            .claim(&Claim {
                key,
                fingerprint: Fingerprint([7; 32]),
                token,
                now,
                lease_ms: 30_000,
                ttl_ms: 60_000,
                first_use: Some(FirstUse::new("POST", "/orders?item=book")),
            })
            .await
            .unwrap();
        let text = show(&store, &key, &clock).await.unwrap();
        assert!(text.contains("state        in_flight"), "{text}");
        assert!(text.contains("first use    POST /orders\n"), "{text}");
        let resp = StoredResponse {
            status: 201,
            headers: vec![("location".into(), Bytes::from_static(b"/o/1"))],
            body: Bytes::from_static(b"{}"),
        };
        store
            .complete(
                &key,
                &token,
                &Completion::Stored(resp),
                Span { now, ms: 60_000 },
            )
            .await
            .unwrap();
        let text = show(&store, &key, &clock).await.unwrap();
        assert!(
            text.contains("status       201") && text.contains("location: /o/1"),
            "{text}"
        );
        assert!(!text.contains("k-1"), "the raw key must not be printed");
        assert!(store.delete(&key).await.unwrap());
        assert!(show(&store, &key, &clock)
            .await
            .unwrap()
            .starts_with("no record"));
        assert_eq!(purge_expired(&store, 10, &clock).await.unwrap(), 0);
    }

    /// A record left outcome-unknown in `store`, with its key.
    async fn unknown_record(store: &MemoryStore, name: &str) -> RecordKey {
        let key = record_key(name, &ScopeArg::Anonymous, &config(&[])).unwrap();
        let (token, now) = (LeaseToken::random(), Clock::system().now_millis());
        let claim = Claim {
            key,
            fingerprint: Fingerprint([7; 32]),
            token,
            now,
            lease_ms: 30_000,
            ttl_ms: 60_000,
            first_use: None,
        };
        store.claim(&claim).await.unwrap();
        let keep = Span { now, ms: 60_000 };
        let done = store.complete(&key, &token, &Completion::Unknown, keep);
        assert_eq!(done.await.unwrap(), crate::store::Fence::Held);
        key
    }

    #[tokio::test]
    async fn resolve_settles_only_an_unknown_outcome_and_show_prints_an_applied_one() {
        let store = MemoryStore::new();
        let clock = Clock::system();
        let now = clock.now_millis();
        let released = unknown_record(&store, "k-released").await;
        assert!(store
            .resolve(&released, &Verdict::NotApplied, now)
            .await
            .unwrap());
        assert_eq!(store.get(&released).await.unwrap(), None);
        // Nothing is left to resolve.
        assert!(!store
            .resolve(&released, &Verdict::NotApplied, now)
            .await
            .unwrap());

        let applied = unknown_record(&store, "k-applied").await;
        let verdict = Verdict::Applied {
            reason: "ledger shows it once".into(),
        };
        assert!(store.resolve(&applied, &verdict, now).await.unwrap());
        let record = store.get(&applied).await.unwrap().unwrap();
        assert_eq!(
            record.state,
            RecordState::Unstored {
                status: RESOLVED_STATUS
            }
        );
        let text = show(&store, &applied, &clock).await.unwrap();
        assert!(text.contains("state        unstored"), "{text}");
        assert!(text.contains("status       none (executed"), "{text}");
        assert!(text.contains(": ledger shows it once\n"), "{text}");
        assert!(text.contains("resolved     applied at "), "{text}");
        assert!(!text.contains("k-applied"), "{text}");
        // Settled once: neither verdict applies again.
        assert!(!store
            .resolve(&applied, &Verdict::NotApplied, now)
            .await
            .unwrap());
        let refusal = not_unknown(&applied, &record, now);
        assert!(refusal.contains("already resolved as applied"), "{refusal}");
        assert!(refusal.contains(&applied.log_id().to_string()), "{refusal}");
    }

    #[test]
    fn a_refusal_says_what_state_the_record_is_in() {
        let key = record_key("k", &ScopeArg::Anonymous, &config(&[])).unwrap();
        let record = |state| Record {
            fingerprint: Fingerprint([1; 32]),
            state,
            created_at: 0,
            expires_at: 10_000,
            first_use: None,
        };
        let resp = StoredResponse {
            status: 201,
            headers: vec![],
            body: Bytes::new(),
        };
        for (state, says) in [
            (
                RecordState::InFlight {
                    locked_until: 5_000,
                },
                "its lease is live until",
            ),
            (RecordState::InFlight { locked_until: 500 }, "lease expired"),
            (RecordState::Completed(resp), "completed with status 201"),
            (
                RecordState::Unstored { status: 200 },
                "status 200, response not stored",
            ),
        ] {
            let text = not_unknown(&key, &record(state), 1_000);
            assert!(text.contains(says), "{text}");
            assert!(
                text.contains("resolve settles only unknown outcomes"),
                "{text}"
            );
        }
    }

    #[test]
    fn a_reason_is_one_bounded_line_of_text() {
        assert_eq!(
            parse_reason("  checked the ledger \n").unwrap(),
            "checked the ledger"
        );
        for bad in ["", "   ", "two\nlines", "bell\u{7}"] {
            assert!(parse_reason(bad).is_err(), "{bad:?}");
        }
        assert!(parse_reason(&"é".repeat(MAX_REASON_CHARS)).is_ok());
        assert!(parse_reason(&"x".repeat(MAX_REASON_CHARS + 1)).is_err());
    }

    const SECRET: &str = "a-long-enough-secret";

    /// A config with a scope secret and one `POST` route per list of scope
    /// headers, on `/r1`, `/r2`, ...
    fn config(scopes: &[&str]) -> Config {
        let mut text = "[server]\nupstream = \"http://127.0.0.1:1\"\n".to_string();
        for (i, headers) in scopes.iter().enumerate() {
            text += &format!(
                "[[route]]\nmethods = [\"POST\"]\npath = \"/r{}\"\nscope_headers = {headers}\n",
                i + 1
            );
        }
        let env = [("IDEMGATE_SCOPE_SECRET".to_string(), SECRET.to_string())].into();
        Config::parse_with_env(&text, "t.toml", &env).unwrap()
    }

    fn headers(sent: &[&str], route: Option<usize>) -> ScopeArg {
        ScopeArg::Headers {
            sent: sent.iter().map(|h| h.parse().unwrap()).collect(),
            route,
        }
    }

    /// The scope the proxy derives for a request with these headers on
    /// route #`index`.
    fn proxy_scope(config: &Config, index: usize, sent: &[(&str, &str)]) -> Scope {
        let route = config.routes.iter().find(|r| r.index == index).unwrap();
        let mut h = http::HeaderMap::new();
        for (name, value) in sent {
            h.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
        }
        let sent = crate::proxy::headers::fields(&h, &route.scope_headers);
        Scope::of_fields(&sent, Some(SECRET.as_bytes())).unwrap()
    }

    #[test]
    fn a_scope_header_value_is_refused_where_a_route_has_several_scope_headers() {
        let value = ScopeArg::HeaderValue("Bearer t".into());
        let one = config(&[r#"["Authorization"]"#, r#"["X-Api-Key"]"#]);
        assert!(value.resolve(&one).is_ok());
        let several = config(&[r#"["Authorization"]"#, r#"["Authorization", "X-Tenant"]"#]);
        let err = value.resolve(&several).unwrap_err();
        assert!(
            err.contains("route #2 /r2 scopes keys by authorization,x-tenant")
                && err.contains("--scope-header 'authorization=...' --scope-header 'x-tenant=...'"),
            "{err}"
        );
        // The form it points to names the same scope as the proxy.
        let sent = [("authorization", "Bearer t"), ("x-tenant", "t1")];
        let each = headers(&["Authorization=Bearer t", "X-Tenant=t1"], None);
        assert_eq!(each.resolve(&several), Ok(proxy_scope(&several, 2, &sent)));
    }

    #[test]
    fn a_key_id_from_a_log_line_refuses_another_scope_and_names_the_open_one() {
        let text = "[server]\nupstream = \"http://127.0.0.1:1\"\n[[route]]\npath = \"/hooks/stripe\"\npreset = \"stripe\"\n";
        let env = [("IDEMGATE_SCOPE_SECRET".to_string(), SECRET.to_string())].into();
        let config = Config::parse_with_env(text, "t.toml", &env).unwrap();
        let logged = record_key(
            "evt_1",
            &ScopeArg::Value("stripe:/hooks/stripe".into()),
            &config,
        )
        .unwrap();
        let id = logged.log_id();
        assert_eq!(
            check_key_id("evt_1", &logged, &id.to_uppercase(), &config),
            Ok(())
        );
        let wrong = record_key("evt_1", &ScopeArg::Anonymous, &config).unwrap();
        let err = check_key_id("evt_1", &wrong, &id, &config).unwrap_err();
        assert!(
            err.contains(&format!("key id {id} is not this key in the scope named"))
                && err.contains("it is this key with --scope-value 'stripe:/hooks/stripe'"),
            "{err}"
        );
        let err = check_key_id("evt_2", &wrong, &id, &config).unwrap_err();
        assert!(err.contains("nor is it this key"), "{err}");
        assert!(check_key_id("evt_1", &logged, "abc", &config).is_err());
    }

    /// `--consumer NAME` names the scope a `[[consumer]]` gives its
    /// messages' keys, and only a consumer the config has.
    #[test]
    fn a_consumer_names_the_scope_of_its_messages() {
        let text = "[server]\nupstream = \"http://127.0.0.1:3000\"\n[[consumer]]\nname = \"reserve\"\nsource = { amqp = { url = \"amqp://h\", queue = \"q\" } }\ndeliver = { path = \"/in\" }\n";
        let config = Config::parse(text, "c.toml").unwrap();
        let ours = ScopeArg::Consumer("reserve".into())
            .resolve(&config)
            .unwrap();
        assert_eq!(ours, Scope::of_value("reserve", None));
        let err = ScopeArg::Consumer("other".into())
            .resolve(&config)
            .unwrap_err();
        assert!(err.contains("it has: reserve"), "{err}");
    }

    #[test]
    fn scope_hash_must_be_hex() {
        let config = config(&[]);
        assert!(ScopeArg::Hash("zz".into()).resolve(&config).is_err());
        let s = Scope::from_header_value(None);
        assert!(ScopeArg::Hash(s.to_hex()).resolve(&config).unwrap() == s);
    }

    /// A delivery route's fixed consumer name (`scope = { value }`, as a
    /// preset sets it) names the scope the proxy gives its deliveries.
    #[test]
    fn a_scope_value_names_the_scope_of_a_consumer_route() {
        let text = "[server]\nupstream = \"http://127.0.0.1:1\"\n[[route]]\npath = \"/hooks/stripe\"\npreset = \"stripe\"\n";
        let env = [("IDEMGATE_SCOPE_SECRET".to_string(), SECRET.to_string())].into();
        let config = Config::parse_with_env(text, "t.toml", &env).unwrap();
        let route = config.routes.iter().next().unwrap();
        let secret = config.scope_secret.as_ref();
        let proxy = crate::proxy::protected::prepare::scope_of(
            route,
            &http::HeaderMap::new(),
            None,
            secret,
        )
        .unwrap();
        let named = ScopeArg::Value("stripe:/hooks/stripe".into());
        assert_eq!(named.resolve(&config), Ok(proxy));
    }

    #[test]
    fn the_one_header_forms_name_the_scope_the_proxy_derives() {
        let config = config(&[r#"["Authorization"]"#]);
        let want = proxy_scope(&config, 1, &[("authorization", "Bearer t")]);
        let value = ScopeArg::HeaderValue("Bearer t".into());
        assert_eq!(value.resolve(&config), Ok(want));
        let named = headers(&["Authorization=Bearer t"], None);
        assert_eq!(named.resolve(&config), Ok(want));
        assert_eq!(
            ScopeArg::Anonymous.resolve(&config),
            Ok(proxy_scope(&config, 1, &[]))
        );
    }

    #[test]
    fn several_scope_headers_are_named_in_the_order_of_their_route() {
        let config = config(&[
            r#"["Authorization"]"#,
            r#"["Authorization", "Stripe-Account"]"#,
            r#"["Stripe-Account", "Authorization"]"#,
        ]);
        let sent = [("authorization", "Bearer sk"), ("stripe-account", "acct_1")];
        // Order on the command line does not matter; the route's does.
        for args in [
            ["Authorization=Bearer sk", "Stripe-Account=acct_1"],
            ["Stripe-Account=acct_1", "Authorization=Bearer sk"],
        ] {
            for route in [2, 3] {
                assert_eq!(
                    headers(&args, Some(route)).resolve(&config),
                    Ok(proxy_scope(&config, route, &sent)),
                    "route #{route}"
                );
            }
            let ambiguous = headers(&args, None).resolve(&config).unwrap_err();
            assert!(
                ambiguous.contains("#2") && ambiguous.contains("#3"),
                "{ambiguous}"
            );
            assert!(ambiguous.contains("--route"), "{ambiguous}");
        }
        // Routes #1 and #2 agree on a request without Stripe-Account; #3 does not.
        let only_auth = headers(&["Authorization=Bearer sk"], Some(2));
        assert_eq!(
            only_auth.resolve(&config),
            Ok(proxy_scope(&config, 1, &[("authorization", "Bearer sk")]))
        );
        // The scope earlier versions gave a request that repeated the header:
        // the proxy refuses those now, but their keys can be named until
        // they expire.
        let two_values = headers(&["Authorization=a", "Authorization=b"], Some(1));
        assert_eq!(
            two_values.resolve(&config),
            Ok(Scope::of_values(
                &[vec![b"a".as_slice(), b"b".as_slice()]],
                Some(SECRET.as_bytes())
            ))
        );

        let unknown = headers(&["X-Tenant-Id=t"], None).resolve(&config);
        assert!(unknown
            .unwrap_err()
            .contains("no route scopes keys by all of x-tenant-id"));
        let wrong_route = headers(&["Stripe-Account=a"], Some(1)).resolve(&config);
        assert!(wrong_route
            .unwrap_err()
            .contains("route #1 scopes keys by authorization"));
        let no_route = headers(&["Authorization=a"], Some(9)).resolve(&config);
        assert!(no_route.unwrap_err().contains("no route #9"));
    }

    #[test]
    fn scope_header_arguments_are_name_value_pairs_and_never_printed() {
        let h: ScopeHeader = "Authorization=Basic dXNlcjpwYXNz==".parse().unwrap();
        assert_eq!(h.name, http::header::AUTHORIZATION);
        assert_eq!(h.value, "Basic dXNlcjpwYXNz==");
        assert!(!format!("{h:?}").contains("dXNl"));
        let empty: ScopeHeader = "Stripe-Account=".parse().unwrap();
        assert_eq!(empty.value, "");
        assert!("Bearer x".parse::<ScopeHeader>().is_err());
        assert!("bad name=x".parse::<ScopeHeader>().is_err());
    }
}
