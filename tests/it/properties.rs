//! Property tests (proptest) for the pure pieces that read hostile input
//! or lay out stored bytes (issue 9, "prove it stays fixed"): path
//! normalization and route matching, the forwarder's join with the
//! upstream's base path, the key parser, the SQL and Redis record
//! layouts, and sealed responses. The same properties run for longer as fuzz targets
//! (`scripts/fuzz.sh`); these keep the default case counts, so the module
//! runs in about a second.

use bytes::Bytes;
use http::{Method, Uri};
use idemgate::config::Config;
use idemgate::fuzzing::{
    completion_row, decode_headers, encode_headers, normalize_path, redis_decode,
    redis_encode_lock, redis_encode_record, upstream_uri, Cached,
};
use idemgate::idempotency::key::MAX_KEY_LEN;
use idemgate::idempotency::{
    Fingerprint, IdempotencyKey, Record, RecordKey, RecordState, Scope, StoredResponse,
};
use idemgate::store::{Claim, Completion, FirstUse, LeaseToken};
use proptest::prelude::*;
use std::sync::OnceLock;

// ===== paths and routes =====

const ROUTES: &str = r#"
[server]
upstream = "http://127.0.0.1:9/base"
[[route]]
methods = ["POST"]
path = "/orders"
[[route]]
methods = ["POST"]
path = "/payments/{id}/capture"
[[route]]
methods = ["POST"]
path = "/api/v1/*"
"#;

/// The route table above (and its upstream, `http://127.0.0.1:9/base`).
fn config() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(|| Config::parse(ROUTES, "properties.toml").expect("valid"))
}

/// The index of the route `path` (as sent) selects, if any.
fn route_of(path: &str) -> Option<usize> {
    config()
        .routes
        .find(&Method::POST, &normalize_path(path))
        .map(|r| r.index)
}

/// Segments that normalization treats specially, and plain ones.
fn tricky_segment() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just(".".into()),
        Just("..".into()),
        Just("%2e".into()),
        Just("%2E%2e".into()),
        Just(".%2e".into()),
        Just("..;x".into()),
        Just(";x".into()),
        Just("%2F".into()),
        Just("%".into()),
        Just("%%36F".into()),
        Just("%6f%2".into()),
        Just("orders".into()),
        Just("%6Frders".into()),
        Just("orders;v=1".into()),
        "[a-zA-Z0-9._~%;=-]{0,6}",
        "\\PC{0,4}",
    ]
}

/// A path of tricky segments; absolute unless `relative` is drawn.
fn tricky_path() -> impl Strategy<Value = String> {
    (prop::collection::vec(tricky_segment(), 0..6), any::<bool>()).prop_map(|(segs, trailing)| {
        let mut path = String::new();
        for seg in segs {
            path.push('/');
            path.push_str(&seg);
        }
        if trailing || path.is_empty() {
            path.push('/');
        }
        path
    })
}

/// A path the route table knows (or does not), in its plainest spelling.
fn canonical_path() -> impl Strategy<Value = Vec<String>> {
    let id = "[a-z0-9_]{1,8}";
    prop_oneof![
        Just(vec!["orders".to_string()]),
        id.prop_map(|id| vec!["payments".into(), id, "capture".into()]),
        prop::collection::vec("[a-z0-9_]{1,6}", 0..3).prop_map(|rest| {
            let mut segs = vec!["api".to_string(), "v1".to_string()];
            segs.extend(rest);
            segs
        }),
        prop::collection::vec("[a-z0-9_]{1,6}", 0..4),
    ]
}

/// One way to respell a segment: each returns a spelling that names the
/// same resource to a servlet-style upstream and to the route matcher.
#[derive(Clone, Debug)]
enum Respelling {
    /// `%XX` (upper- or lowercase hex) for the unreserved character at `at`.
    Escape { at: usize, lower: bool },
    /// A `;name=value` path parameter after the segment.
    Parameter(String),
    /// An empty segment before it (`//`).
    ExtraSlash,
    /// A `.` segment before it.
    Dot,
    /// `x/..` before it.
    DotDot(String),
}

fn respelling() -> impl Strategy<Value = Respelling> {
    prop_oneof![
        (any::<usize>(), any::<bool>()).prop_map(|(at, lower)| Respelling::Escape { at, lower }),
        "[a-z]{0,4}(=[a-z0-9]{0,4})?".prop_map(Respelling::Parameter),
        Just(Respelling::ExtraSlash),
        Just(Respelling::Dot),
        "[a-z]{1,4}".prop_map(Respelling::DotDot),
    ]
}

/// Where `s` has a letter or digit that is not part of a `%XX` escape.
fn literal_alphanumerics(s: &str) -> Vec<usize> {
    let bytes = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            i += 3;
            continue;
        }
        if bytes[i].is_ascii_alphanumeric() {
            out.push(i);
        }
        i += 1;
    }
    out
}

fn respell(segment: &str, how: &[Respelling]) -> String {
    let mut out = segment.to_string();
    for r in how {
        out = match r {
            Respelling::Escape { at, lower } => {
                let plain = literal_alphanumerics(&out);
                if plain.is_empty() {
                    out
                } else {
                    let i = plain[at % plain.len()];
                    let escaped = format!("%{:02X}", out.as_bytes()[i]);
                    let escaped = if *lower {
                        escaped.to_ascii_lowercase()
                    } else {
                        escaped
                    };
                    format!("{}{}{}", &out[..i], escaped, &out[i + 1..])
                }
            }
            Respelling::Parameter(p) => format!("{out};{p}"),
            Respelling::ExtraSlash => format!("/{out}"),
            Respelling::Dot => format!("./{out}"),
            Respelling::DotDot(x) => format!("{x}/../{out}"),
        };
    }
    out
}

proptest! {
    #[test]
    fn normalize_path_is_idempotent(path in tricky_path()) {
        let once = normalize_path(&path);
        prop_assert!(once.starts_with('/'));
        prop_assert_eq!(normalize_path(&once), once.clone());
    }

    /// Extra slashes, `.` and `x/..` segments, escaped unreserved
    /// characters and `;` parameters never change which route a path
    /// selects, or whether it selects one.
    #[test]
    fn equivalent_spellings_select_the_same_route(
        segments in canonical_path(),
        how in prop::collection::vec(prop::collection::vec(respelling(), 0..3), 4),
        trailing_slash in any::<bool>(),
    ) {
        let canonical = format!("/{}", segments.join("/"));
        let mut spelled: String = segments
            .iter()
            .zip(how.iter().cycle())
            .map(|(seg, how)| format!("/{}", respell(seg, how)))
            .collect();
        if trailing_slash || spelled.is_empty() {
            spelled.push('/');
        }
        prop_assert_eq!(
            route_of(&spelled),
            route_of(&canonical),
            "{} vs {}",
            spelled,
            canonical
        );
    }

    /// Whatever an admitted target's path (one starting with `/`), the
    /// forwarder's join keeps it below the upstream's base path, as sent
    /// and as the upstream would normalize it.
    #[test]
    fn a_joined_path_never_leaves_the_base(path in tricky_path(), query in proptest::option::of("[a-z=&./%]{0,8}")) {
        let target = match &query {
            Some(q) => format!("{path}?{q}"),
            None => path.clone(),
        };
        let Ok(original) = target.parse::<Uri>() else {
            return Ok(());
        };
        prop_assume!(original.path().starts_with('/'));
        let joined = upstream_uri(&config().server.upstream, &original, None)
            .expect("a valid target joins");
        let below = |p: &str| p == "/base" || p.starts_with("/base/");
        prop_assert!(below(joined.path()), "{} -> {}", target, joined);
        prop_assert!(below(&normalize_path(joined.path())), "{} -> {}", target, joined);
        prop_assert_eq!(joined.query(), original.query());
    }
}

// ===== the key parser =====

/// What docs/book/src/semantics.md and `key.rs` document: optional whitespace around
/// either a bare key or an RFC 9651 sf-string (`\"` and `\\` escapes), the
/// key being 1 to 255 printable ASCII characters.
fn documented_key(raw: &[u8]) -> Option<String> {
    let start = raw.iter().position(|b| !matches!(b, b' ' | b'\t'));
    let end = raw.iter().rposition(|b| !matches!(b, b' ' | b'\t'));
    let raw = match (start, end) {
        (Some(s), Some(e)) => &raw[s..=e],
        _ => return None,
    };
    let printable = |b: u8| (0x20..=0x7e).contains(&b);
    let key = if raw[0] == b'"' {
        let inner = raw.strip_prefix(b"\"")?.strip_suffix(b"\"")?;
        let mut key = Vec::new();
        let mut bytes = inner.iter().copied();
        while let Some(b) = bytes.next() {
            match b {
                b'\\' => match bytes.next() {
                    Some(c @ (b'"' | b'\\')) => key.push(c),
                    _ => return None,
                },
                b'"' => return None,
                b if printable(b) => key.push(b),
                _ => return None,
            }
        }
        key
    } else {
        raw.iter().all(|&b| printable(b)).then(|| raw.to_vec())?
    };
    let key = String::from_utf8(key).ok()?;
    (!key.is_empty() && key.len() <= MAX_KEY_LEN).then_some(key)
}

fn quote(key: &str) -> String {
    let escaped = key.replace('\\', "\\\\").replace('"', "\\\"");
    format!("\"{escaped}\"")
}

fn header_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        "[ \\t]{0,2}[ -~]{0,260}[ \\t]{0,2}".prop_map(String::into_bytes),
        "[ -~]{0,20}".prop_map(|s| quote(&s).into_bytes()),
        "\"[ -~]{0,12}\"?".prop_map(String::into_bytes),
        prop::collection::vec(any::<u8>(), 0..20),
    ]
}

proptest! {
    #[test]
    fn the_key_parser_accepts_exactly_the_documented_keys(raw in header_value()) {
        let parsed = IdempotencyKey::parse(&raw).ok();
        let documented = documented_key(&raw);
        prop_assert_eq!(
            parsed.as_ref().map(IdempotencyKey::as_str),
            documented.as_deref(),
            "{:?}",
            String::from_utf8_lossy(&raw)
        );
    }

    #[test]
    fn quoted_and_bare_forms_are_the_same_key(key in "[!-~]([ -~]{0,253}[!-~])?") {
        prop_assume!(!key.starts_with('"'));
        let bare = IdempotencyKey::parse(key.as_bytes()).expect("a bare key");
        let quoted = IdempotencyKey::parse(quote(&key).as_bytes()).expect("a quoted key");
        prop_assert_eq!(bare.as_str(), key.as_str());
        prop_assert_eq!(quoted.as_str(), key.as_str());
        let scope = Scope::from_header_value(Some(b"Bearer t"));
        prop_assert_eq!(RecordKey::new(scope, &bare), RecordKey::new(scope, &quoted));
    }
}

// ===== stored records =====

fn headers() -> impl Strategy<Value = Vec<(String, Bytes)>> {
    prop::collection::vec(
        ("\\PC{0,12}", prop::collection::vec(any::<u8>(), 0..16))
            .prop_map(|(name, value)| (name, Bytes::from(value))),
        0..6,
    )
}

fn completion() -> impl Strategy<Value = Completion> {
    prop_oneof![
        (
            any::<u16>(),
            headers(),
            prop::collection::vec(any::<u8>(), 0..64)
        )
            .prop_map(
                |(status, headers, body)| Completion::Stored(StoredResponse {
                    status,
                    headers,
                    body: Bytes::from(body),
                })
            ),
        any::<u16>().prop_map(|status| Completion::Unstored { status }),
        Just(Completion::Unknown),
    ]
}

proptest! {
    #[test]
    fn the_header_codec_round_trips(headers in headers()) {
        let encoded = encode_headers(&headers);
        prop_assert_eq!(decode_headers(&encoded).ok(), Some(headers));
        if !encoded.is_empty() {
            prop_assert!(decode_headers(&encoded[..encoded.len() - 1]).is_err());
        }
    }

    /// Any bytes that decode as a header block are the encoding of what
    /// they decode to: one layout, no second spelling.
    #[test]
    fn a_decoded_header_block_is_canonical(raw in prop::collection::vec(any::<u8>(), 0..64)) {
        if let Ok(headers) = decode_headers(&raw) {
            prop_assert_eq!(encode_headers(&headers), raw);
        }
    }

    /// What a SQL backend writes for a completion reads back as the state
    /// that completion leaves.
    #[test]
    fn record_rows_round_trip(
        completion in completion(),
        fp in any::<[u8; 32]>(),
        created_at in any::<i64>(),
        expires_at in any::<i64>(),
    ) {
        let fingerprint = Fingerprint(fp);
        let record = completion_row(&completion, &fingerprint, created_at, expires_at)
            .into_record()
            .expect("a written row reads back");
        prop_assert_eq!(record, Record {
            fingerprint,
            state: RecordState::from(&completion),
            created_at,
            expires_at,
            first_use: None,
        });
    }

    /// Completed and unstored records, and locks, round-trip through the
    /// Redis value layout; the token sits where the Lua scripts read it.
    #[test]
    fn redis_values_round_trip(
        completion in completion(),
        fp in any::<[u8; 32]>(),
        created_at in any::<i64>(),
        expires_at in any::<i64>(),
        token in any::<[u8; 16]>(),
        now in 0..i64::MAX / 4,
        ttl_ms in 0..i64::MAX / 4,
        first in prop::option::of(("[A-Z]{0,40}", "\\PC{0,300}")),
    ) {
        let fingerprint = Fingerprint(fp);
        let first_use = first.map(|(method, path)| FirstUse::new(&method, &path));
        let record = Record {
            fingerprint,
            state: RecordState::from(&completion),
            created_at,
            expires_at,
            first_use: first_use.clone(),
        };
        match redis_encode_record(&record) {
            Some(value) => prop_assert_eq!(redis_decode(&value).ok(), Some(Cached::Record(record))),
            None => prop_assert_eq!(completion, Completion::Unknown),
        }
        let claim = Claim {
            key: RecordKey { scope: Scope([7; 32]), key: [8; 32] },
            fingerprint,
            token: LeaseToken(token),
            now,
            lease_ms: ttl_ms / 2,
            ttl_ms,
            first_use: first_use.clone(),
        };
        let value = redis_encode_lock(&claim);
        prop_assert_eq!(&value[49..65], &token[..]);
        prop_assert_eq!(
            redis_decode(&value).ok(),
            Some(Cached::Lock {
                token: LeaseToken(token),
                fingerprint,
                created_at: now,
                expires_at: now + ttl_ms,
                first_use,
            })
        );
    }

    /// Garbage is a corrupt record, never a panic.
    #[test]
    fn any_redis_value_decodes_or_is_corrupt(raw in prop::collection::vec(any::<u8>(), 0..96)) {
        let _ = redis_decode(&raw);
    }
}

// ===== sealed responses (issue 21) =====

fn key_ring(ids: &[(&str, u8)]) -> idemgate::idempotency::vault::KeyRing {
    use base64::Engine;
    let list: Vec<String> = ids
        .iter()
        .map(|(id, b)| {
            format!(
                "{id}:{}",
                base64::engine::general_purpose::STANDARD.encode([*b; 32])
            )
        })
        .collect();
    idemgate::idempotency::vault::KeyRing::parse(&list.join(",")).expect("a key list")
}

/// `sealed` written and read back by each store's codec: a SQL row
/// (SQLite, PostgreSQL) and a Redis value.
fn stored_as_each_store_keeps_it(sealed: &StoredResponse) -> Vec<StoredResponse> {
    let completion = Completion::Stored(sealed.clone());
    let fingerprint = Fingerprint([5; 32]);
    let row = completion_row(&completion, &fingerprint, 1_000, 2_000)
        .into_record()
        .expect("a written row reads back");
    let value = redis_encode_record(&Record {
        fingerprint,
        state: RecordState::from(&completion),
        created_at: 1_000,
        expires_at: 2_000,
        first_use: Some(FirstUse::new("POST", "/orders")),
    })
    .expect("a completed record is cached");
    let cached = match redis_decode(&value) {
        Ok(Cached::Record(record)) => record,
        other => panic!("a Redis value reads back: {other:?}"),
    };
    [row, cached]
        .into_iter()
        .map(|record| match record.state {
            RecordState::Completed(kept) => kept,
            other => panic!("completed, read back as {other:?}"),
        })
        .collect()
}

proptest! {
    /// Any response sealed for a record opens, for that record alone, to
    /// exactly what was sealed; a key ring that also lists newer keys opens
    /// it; flipping any one byte of what is stored makes it not open. What
    /// is opened is the sealed response as each store keeps it: through
    /// the SQL row and the Redis value codecs and back.
    #[test]
    fn a_sealed_response_round_trips_and_any_altered_byte_is_refused(
        status in any::<u16>(),
        headers in headers(),
        body in prop::collection::vec(any::<u8>(), 0..64),
        scope in any::<[u8; 32]>(),
        key in any::<[u8; 32]>(),
        other in any::<[u8; 32]>(),
        flip in any::<prop::sample::Index>(),
    ) {
        use idemgate::store::sealed::{open_response, seal_response, is_sealed};
        let record = RecordKey { scope: Scope(scope), key };
        let resp = StoredResponse { status, headers, body: Bytes::from(body) };
        let old = key_ring(&[("old", 1)]);
        let rotated = key_ring(&[("new", 2), ("old", 1)]);
        let sealed = seal_response(&old, &record, &resp);
        prop_assert!(is_sealed(&sealed));
        for kept in stored_as_each_store_keeps_it(&sealed) {
            prop_assert_eq!(&kept, &sealed);
            prop_assert_eq!(open_response(&old, &record, &kept).ok().flatten(), Some(resp.clone()));
            prop_assert_eq!(open_response(&rotated, &record, &kept).ok().flatten(), Some(resp.clone()));
        }
        prop_assume!(other != key);
        let elsewhere = RecordKey { scope: Scope(scope), key: other };
        prop_assert!(open_response(&old, &elsewhere, &sealed).is_err());
        let mut altered = sealed.clone();
        let mut bytes = altered.body.to_vec();
        let i = flip.index(bytes.len());
        bytes[i] ^= 0x01;
        altered.body = Bytes::from(bytes);
        prop_assert!(open_response(&old, &record, &altered).is_err(), "byte {} flipped", i);
    }
}
