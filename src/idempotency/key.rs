//! The `Idempotency-Key` header and the scoped record key derived from it.
//!
//! The IETF draft (§2.1) makes the field an RFC 9651 sf-string, i.e. quoted,
//! but Stripe's clients send it bare. Both forms are accepted and `"abc"` is
//! the same key as `abc`. Keys are at most 255 printable ASCII characters
//! (Stripe's limit). Neither the key nor the scope credential is ever stored
//! or logged raw: the store holds sha256 digests only.

use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::fmt;

/// Stripe's documented maximum; the IETF draft gives none.
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key (the unquoted value).
#[derive(Clone, PartialEq, Eq)]
pub struct IdempotencyKey(String);

/// Why a key header was rejected (each is a 400).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("the key is empty")]
    Empty,
    #[error("the key is longer than {MAX_KEY_LEN} characters")]
    TooLong,
    #[error("the key contains characters other than printable ASCII")]
    NotPrintable,
    #[error("the key is a malformed quoted string")]
    BadQuoting,
    #[error("the header appears more than once")]
    Repeated,
}

impl IdempotencyKey {
    /// Parses one header value, quoted (sf-string) or bare.
    pub fn parse(raw: &[u8]) -> Result<Self, KeyError> {
        let raw = trim_ows(raw);
        if raw.first() == Some(&b'"') {
            Self::from_value(&unquote(raw)?)
        } else {
            Self::from_value(std::str::from_utf8(raw).map_err(|_| KeyError::NotPrintable)?)
        }
    }

    /// A key taken from a JSON body (a natural key such as a message id):
    /// the same rules as a header's value, without quoting or trimming.
    pub fn from_value(value: &str) -> Result<Self, KeyError> {
        if value.is_empty() {
            return Err(KeyError::Empty);
        }
        if value.bytes().any(|b| !(0x20..=0x7e).contains(&b)) {
            return Err(KeyError::NotPrintable);
        }
        if value.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong);
        }
        Ok(Self(value.to_string()))
    }

    /// The key from the values its header was sent with: `Ok(None)` when
    /// absent; two are ambiguous and refused.
    pub fn from_fields(values: &[&[u8]]) -> Result<Option<Self>, KeyError> {
        match values {
            [] => Ok(None),
            [one] => Self::parse(one).map(Some),
            _ => Err(KeyError::Repeated),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Never print the key itself.
impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("IdempotencyKey(..)")
    }
}

fn trim_ows(mut b: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = b {
        b = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = b {
        b = rest;
    }
    b
}

/// RFC 9651 §4.2.5: a string is DQUOTE *( unescaped / "\" ( DQUOTE / "\" ) ) DQUOTE.
fn unquote(raw: &[u8]) -> Result<String, KeyError> {
    let inner = raw
        .strip_prefix(b"\"")
        .and_then(|r| r.strip_suffix(b"\""))
        .ok_or(KeyError::BadQuoting)?;
    let mut out = String::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&c @ (b'"' | b'\\')) => out.push(c as char),
                _ => return Err(KeyError::BadQuoting),
            },
            b'"' => return Err(KeyError::BadQuoting),
            0x20..=0x7e => out.push(b as char),
            _ => return Err(KeyError::NotPrintable),
        }
    }
    Ok(out)
}

/// A scope header sent more than once (400).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the {0} header appears more than once; it decides whose key this is, so send it once")]
pub struct RepeatedScopeHeader(pub http::HeaderName);

/// Who a key belongs to: a digest of the route's scope headers (the
/// credential, plus any tenant header), so two clients using the same key
/// never meet, and no credential is stored.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Scope(pub [u8; 32]);

impl Scope {
    /// The scope of a request whose scope header is `value` (None = absent,
    /// which is its own shared "anonymous" scope).
    pub fn from_header_value(value: Option<&[u8]>) -> Self {
        Self::derive(value, None)
    }

    /// The scope of a request with one scope header, `value` (None = absent).
    /// With `secret` (from `IDEMGATE_SCOPE_SECRET`) the digest is an
    /// HMAC-SHA256, so someone who can read the store or Redis key names
    /// cannot test guessed credentials against it offline.
    ///
    /// This `v1` encoding is what every stored key was made with before
    /// routes could list several headers; it must never change.
    pub fn derive(value: Option<&[u8]>, secret: Option<&[u8]>) -> Self {
        let mut input = Vec::with_capacity(20 + value.map_or(0, <[u8]>::len));
        input.extend_from_slice(b"idemgate/scope/v1\0");
        input.push(u8::from(value.is_some()));
        input.extend_from_slice(value.unwrap_or_default());
        Self::digest(&input, secret)
    }

    /// The scope of a request from what it sent of each of the route's
    /// scope headers, in the route's order. Each must be sent at most once: which of two
    /// values selects the client is ambiguous (an upstream may read either),
    /// so a repeat is refused. `Cookie` fields are joined with "; " instead,
    /// as HTTP/2 splits them (RFC 9113 §8.2.3) and the upstream gets them.
    pub fn of_fields(
        sent: &[(&http::HeaderName, Vec<&[u8]>)],
        secret: Option<&[u8]>,
    ) -> Result<Self, RepeatedScopeHeader> {
        let mut values: Vec<Vec<Cow<'_, [u8]>>> = Vec::with_capacity(sent.len());
        for &(name, ref sent) in sent {
            values.push(match sent[..] {
                [] => Vec::new(),
                [one] => vec![Cow::Borrowed(one)],
                _ if *name == http::header::COOKIE => vec![Cow::Owned(sent.join(&b"; "[..]))],
                _ => return Err(RepeatedScopeHeader(name.clone())),
            });
        }
        Ok(Self::of_values(&values, secret))
    }

    /// `values[i]` holds the values of the route's `i`-th scope header as
    /// sent, in order (empty: absent).
    ///
    /// Absent headers at the end are dropped first; what is left is either
    /// at most one header sent at most once, digested as [`Scope::derive`]
    /// has always done, or anything else, digested in a `v2` encoding where
    /// every count and length is prefixed, so no two combinations share an
    /// input (absent differs from empty, `["ab"]` from `["a", "b"]`, and a
    /// value cannot run into the next header's). Two consequences: a route
    /// listing one header computes the same scopes as before `scope_headers`
    /// existed, and adding a tenant header to a route leaves the scope of
    /// every request that does not send it unchanged (its keys in flight
    /// keep deduplicating across the config change).
    pub fn of_values<V: AsRef<[u8]>>(values: &[Vec<V>], secret: Option<&[u8]>) -> Self {
        let sent = values
            .iter()
            .rposition(|v| !v.is_empty())
            .map_or(0, |i| i + 1);
        let values = &values[..sent];
        match values {
            [] => return Self::derive(None, secret),
            [only] if only.len() == 1 => return Self::derive(Some(only[0].as_ref()), secret),
            _ => {}
        }
        let mut input = Vec::with_capacity(
            64 + values
                .iter()
                .flatten()
                .map(|v| 8 + v.as_ref().len())
                .sum::<usize>(),
        );
        input.extend_from_slice(b"idemgate/scope/v2\0");
        input.extend_from_slice(&(values.len() as u64).to_be_bytes());
        for header in values {
            input.extend_from_slice(&(header.len() as u64).to_be_bytes());
            for value in header {
                let value = value.as_ref();
                input.extend_from_slice(&(value.len() as u64).to_be_bytes());
                input.extend_from_slice(value);
            }
        }
        Self::digest(&input, secret)
    }

    /// The scope of a route with a fixed consumer name (`scope = { value
    /// = "stripe" }`): its own encoding, so it never equals a scope derived
    /// from headers, and keyed by the scope secret like every other.
    pub fn of_value(value: &str, secret: Option<&[u8]>) -> Self {
        let mut input = Vec::with_capacity(32 + value.len());
        input.extend_from_slice(b"idemgate/scope/value/v1\0");
        input.extend_from_slice(value.as_bytes());
        Self::digest(&input, secret)
    }

    /// The scope of a client certificate (`scope = { client_cert = true }`),
    /// by the SHA-256 digest of its SubjectPublicKeyInfo: its own
    /// encoding, so it never equals a scope of headers or a value.
    pub fn of_client_cert(spki_sha256: &[u8; 32], secret: Option<&[u8]>) -> Self {
        let mut input = Vec::with_capacity(64);
        input.extend_from_slice(b"idemgate/scope/client-cert/v1\0");
        input.extend_from_slice(spki_sha256);
        Self::digest(&input, secret)
    }

    fn digest(input: &[u8], secret: Option<&[u8]>) -> Self {
        match secret {
            None => Self(Sha256::digest(input).into()),
            Some(secret) => {
                use hmac::{Hmac, Mac};
                let mut mac = Hmac::<Sha256>::new_from_slice(secret)
                    .expect("HMAC accepts keys of any length");
                mac.update(input);
                Self(mac.finalize().into_bytes().into())
            }
        }
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Scope({})", &self.to_hex()[..12])
    }
}

/// The store's primary key: `(scope, sha256(key))`. Ordered as the SQL
/// backends order it (the bytes of the scope, then of the key), so a scan
/// by primary key pages the same way on every backend.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecordKey {
    pub scope: Scope,
    pub key: [u8; 32],
}

impl RecordKey {
    pub fn new(scope: Scope, key: &IdempotencyKey) -> Self {
        Self {
            scope,
            key: hash_key(key.as_str()),
        }
    }

    /// A short, non-reversible id for logs: the first 8 bytes of
    /// sha256(scope || key digest), so it reveals neither.
    pub fn log_id(&self) -> String {
        let mut h = Sha256::new();
        h.update(self.scope.0);
        h.update(self.key);
        hex::encode(&h.finalize()[..8])
    }
}

impl fmt::Debug for RecordKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RecordKey({})", self.log_id())
    }
}

/// sha256 of a key's text, as stored.
pub fn hash_key(key: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"idemgate/key/v1\0");
    h.update(key.as_bytes());
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_parsing_table() {
        let long = "a".repeat(MAX_KEY_LEN);
        let too_long = "a".repeat(MAX_KEY_LEN + 1);
        let cases: Vec<(&[u8], Result<&str, KeyError>)> = vec![
            (b"abc", Ok("abc")),
            (b"\"abc\"", Ok("abc")),
            (b"  abc\t", Ok("abc")),
            (
                b"8e03978e-40d5-43e8-bc93-6894a57f9324",
                Ok("8e03978e-40d5-43e8-bc93-6894a57f9324"),
            ),
            (b"\"a \\\"q\\\" \\\\ b\"", Ok("a \"q\" \\ b")),
            (b"with space", Ok("with space")),
            (long.as_bytes(), Ok(long.as_str())),
            (too_long.as_bytes(), Err(KeyError::TooLong)),
            (b"", Err(KeyError::Empty)),
            (b"\"\"", Err(KeyError::Empty)),
            (b"   ", Err(KeyError::Empty)),
            (b"caf\xc3\xa9", Err(KeyError::NotPrintable)),
            (b"a\x01b", Err(KeyError::NotPrintable)),
            (b"a\x7fb", Err(KeyError::NotPrintable)),
            (b"\"abc", Err(KeyError::BadQuoting)),
            (b"\"a\\nb\"", Err(KeyError::BadQuoting)),
            (b"\"a\"b\"", Err(KeyError::BadQuoting)),
        ];
        for (raw, want) in cases {
            let got = IdempotencyKey::parse(raw);
            assert_eq!(
                got.as_ref().map(|k| k.as_str()).map_err(Clone::clone),
                want,
                "{:?}",
                String::from_utf8_lossy(raw)
            );
        }
    }

    #[test]
    fn quoted_and_bare_forms_are_the_same_record() {
        let scope = Scope::from_header_value(Some(b"Bearer t"));
        let a = RecordKey::new(scope, &IdempotencyKey::parse(b"k-1").unwrap());
        let b = RecordKey::new(scope, &IdempotencyKey::parse(b"\"k-1\"").unwrap());
        assert_eq!(a, b);
    }

    #[test]
    fn scopes_separate_clients_and_absence() {
        let a = Scope::from_header_value(Some(b"Bearer a"));
        let b = Scope::from_header_value(Some(b"Bearer b"));
        let empty = Scope::from_header_value(Some(b""));
        let absent = Scope::from_header_value(None);
        assert_ne!(a, b);
        assert_ne!(empty, absent);
        assert_eq!(a, Scope::from_header_value(Some(b"Bearer a")));
    }

    #[test]
    fn a_scope_secret_changes_every_digest() {
        let v = Some(b"Bearer a".as_slice());
        let plain = Scope::from_header_value(v);
        let keyed = Scope::derive(v, Some(b"s3cret"));
        assert_ne!(plain, keyed);
        assert_eq!(keyed, Scope::derive(v, Some(b"s3cret")));
        assert_ne!(keyed, Scope::derive(v, Some(b"other")));
    }

    /// Pins: the digest of the one-header form stays byte-identical to the
    /// one every stored key was made with (the values below were computed
    /// by the code before `scope_headers` existed), so an upgrade keeps
    /// existing keys matching.
    #[test]
    fn one_header_scopes_are_the_digests_stored_keys_were_made_with() {
        const SECRET: &[u8] = b"a-long-enough-secret";
        let authorization = http::header::AUTHORIZATION;
        for (value, secret, want) in [
            (
                Some("Bearer a"),
                None,
                "296e6ffe2389bad4f42fea9606d1ed0612f566589bb5e36f944875fa16506105",
            ),
            (
                Some("Bearer a"),
                Some(SECRET),
                "e0b5e9a5d1194e97ecde76e0aeecef531f4438e9c266839276f01e9b74132039",
            ),
            (
                Some(""),
                None,
                "9ff568e15170852c316adb8e92735530d9d42973c9463f78e65d5a5abc7c193b",
            ),
            (
                None,
                None,
                "ff72c195e1246dbedd6266524fb94abdc22b79dbbeb3f721446021798f987c55",
            ),
            (
                None,
                Some(SECRET),
                "d3e4e1501a3a0a535ea2b911adbcb8d8224fc47d01e6057ec033a8691757f510",
            ),
        ] {
            let sent = [(
                &authorization,
                value.map(str::as_bytes).into_iter().collect(),
            )];
            let scope = Scope::of_fields(&sent, secret).unwrap();
            assert_eq!(scope.to_hex(), want, "{value:?}");
            let bytes = value.map(str::as_bytes);
            assert_eq!(Scope::derive(bytes, secret).to_hex(), want, "{value:?}");
        }
    }

    #[test]
    fn no_two_combinations_of_scope_headers_share_a_scope() {
        let v = |values: &[&[&str]]| -> Vec<Vec<Vec<u8>>> {
            values
                .iter()
                .map(|h| h.iter().map(|s| s.as_bytes().to_vec()).collect())
                .collect()
        };
        // Each row: the values of a route's scope headers, in its order.
        // Rows ending in an absent header are below: they equal the row
        // without it.
        let rows = [
            v(&[&[]]),
            v(&[&[""]]),
            v(&[&["a"]]),
            v(&[&["ab"]]),
            v(&[&["a", "b"]]),
            v(&[&["b", "a"]]),
            v(&[&["a", ""]]),
            v(&[&["", "a"]]),
            v(&[&["a"], &["b"]]),
            v(&[&["a"], &[""]]),
            v(&[&[""], &["a"]]),
            v(&[&[], &["a"]]),
            v(&[&["a"], &[], &["b"]]),
            v(&[&["a"], &["b"], &[""]]),
            v(&[&[], &["a", "b"]]),
            v(&[&["a"], &["b", "c"]]),
            v(&[&["a", "b"], &["c"]]),
            // A length prefix must not be forgeable from inside a value.
            v(&[&["a\0\0\0\0\0\0\0\x01b"]]),
            v(&[&["a"], &["\0\0\0\0\0\0\0\x01b"]]),
        ];
        let mut seen = std::collections::HashMap::new();
        for (i, row) in rows.iter().enumerate() {
            for secret in [None, Some(b"a-long-enough-secret".as_slice())] {
                let scope = Scope::of_values(row, secret);
                if let Some(j) = seen.insert((scope, secret.is_some()), i) {
                    panic!("rows {j} and {i} share a scope: {:?} / {row:?}", rows[j]);
                }
            }
        }
        // Absent headers at the end do not count: a route that adds a tenant
        // header keeps the scopes of requests that do not send it.
        assert_eq!(
            Scope::of_values(&v(&[&["a"], &[], &[]]), None),
            Scope::from_header_value(Some(b"a"))
        );
        assert_eq!(
            Scope::of_values(&v(&[&[], &[]]), None),
            Scope::from_header_value(None)
        );
        assert_eq!(
            Scope::of_values(&v(&[&["a"], &["b"]]), None),
            Scope::of_values(&v(&[&["a"], &["b"], &[]]), None)
        );
        assert_eq!(
            Scope::of_values(&v(&[&["a", "b"]]), None),
            Scope::of_values(&v(&[&["a", "b"], &[]]), None)
        );
    }

    #[test]
    fn scopes_follow_the_route_order_and_refuse_a_repeated_header() {
        let auth = http::header::AUTHORIZATION;
        let account = http::HeaderName::from_static("stripe-account");
        let scope = |sent: &[(&http::HeaderName, &[&str])]| {
            let sent: Vec<_> = sent
                .iter()
                .map(|&(name, values)| (name, values.iter().map(|v| v.as_bytes()).collect()))
                .collect();
            Scope::of_fields(&sent, None)
        };
        let a = scope(&[(&auth, &["Bearer sk"]), (&account, &["acct_1"])]).unwrap();
        let reversed = scope(&[(&account, &["acct_1"]), (&auth, &["Bearer sk"])]);
        assert_ne!(a, reversed.unwrap());
        assert_ne!(a, scope(&[(&auth, &["Bearer sk"])]).unwrap());
        let other_account = scope(&[(&auth, &["Bearer sk"]), (&account, &["acct_2"])]);
        assert_ne!(a, other_account.unwrap());
        // Pins: a second value was digested too; which one the upstream
        // reads is its choice, so a repeat is refused, never guessed.
        assert_eq!(
            scope(&[(&auth, &["Bearer sk", "Bearer other"])]),
            Err(RepeatedScopeHeader(auth.clone()))
        );
        assert_eq!(
            scope(&[(&auth, &["Bearer sk"]), (&account, &["acct_1", ""])]),
            Err(RepeatedScopeHeader(account.clone()))
        );
    }

    #[test]
    fn split_cookie_fields_are_one_scope_with_the_joined_field() {
        let cookie = http::header::COOKIE;
        let split = Scope::of_fields(&[(&cookie, vec![&b"a=1"[..], b"b=2"])], None);
        let joined = Scope::of_fields(&[(&cookie, vec![&b"a=1; b=2"[..]])], None);
        assert_eq!(split, joined);
        assert_eq!(joined.unwrap(), Scope::from_header_value(Some(b"a=1; b=2")));
    }

    #[test]
    fn a_fixed_consumer_scope_is_its_own_and_keyed_by_the_secret() {
        let stripe = Scope::of_value("stripe", None);
        assert_eq!(stripe, Scope::of_value("stripe", None));
        assert_ne!(stripe, Scope::of_value("github", None));
        assert_ne!(
            stripe,
            Scope::of_value("stripe", Some(b"a-long-enough-secret"))
        );
        // Never the scope of a request whose scope header says the same.
        assert_ne!(stripe, Scope::from_header_value(Some(b"stripe")));
        assert_ne!(stripe, Scope::from_header_value(None));
    }

    #[test]
    fn keys_from_a_body_follow_the_header_rules_without_quoting() {
        let long = "a".repeat(MAX_KEY_LEN);
        let too_long = format!("{long}a");
        for (v, want) in [
            ("evt_1", Ok("evt_1")),
            ("\"q\"", Ok("\"q\"")),
            (" a ", Ok(" a ")),
            (long.as_str(), Ok(long.as_str())),
            ("", Err(KeyError::Empty)),
            ("é", Err(KeyError::NotPrintable)),
            ("a\nb", Err(KeyError::NotPrintable)),
            (too_long.as_str(), Err(KeyError::TooLong)),
        ] {
            let got = IdempotencyKey::from_value(v);
            assert_eq!(got.as_ref().map(|k| k.as_str()), want.as_deref(), "{v:?}");
        }
    }

    #[test]
    fn repeated_header_is_rejected() {
        assert_eq!(IdempotencyKey::from_fields(&[]), Ok(None));
        assert!(IdempotencyKey::from_fields(&[b"a"]).unwrap().is_some());
        let twice = IdempotencyKey::from_fields(&[b"a", b"b"]);
        assert_eq!(twice, Err(KeyError::Repeated));
    }

    #[test]
    fn debug_output_never_shows_the_key() {
        let k = IdempotencyKey::parse(b"secret-key").unwrap();
        assert!(!format!("{k:?}").contains("secret"));
        let rk = RecordKey::new(Scope::from_header_value(None), &k);
        assert!(!format!("{rk:?}").contains("secret"));
    }

    #[test]
    fn a_client_certificate_scope_is_its_own_and_keyed_by_the_secret() {
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let cert = |spki: &[u8; 32], secret| Scope::of_client_cert(spki, secret);
        assert_ne!(cert(&a, None), cert(&b, None));
        assert_eq!(cert(&a, None), cert(&a, None));
        assert_ne!(cert(&a, None), cert(&a, Some(b"s")));
        // Never a scope of the same bytes sent as a header or a value.
        assert_ne!(cert(&a, None), Scope::of_values(&[vec![a.to_vec()]], None));
        assert_ne!(cert(&a, None), Scope::of_value(&hex::encode(a), None));
    }
}
