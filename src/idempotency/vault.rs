//! Stored responses sealed at rest (issue 21): the key ring read from
//! `IDEMGATE_STORE_ENCRYPTION_KEYS`, and sealing and opening one
//! response's headers and body with AES-256-GCM. No I/O here; the backends
//! decide where the sealed bytes go.
//!
//! A sealed response is `b"IGS1" | id_len:u8 | id | nonce:12 | ciphertext
//! and tag`, where the plaintext is `headers_len:u32 | headers | body` (the
//! headers as `store::codec::encode_headers` writes them). The associated
//! data is the record's scope and key digests and its status, so a sealed
//! response moved to another row or key, or given another status, does not
//! open. A fresh random nonce per seal: 96 bits, safe for far more records
//! than one key ever seals before rotation.

use base64::Engine;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};
use std::collections::HashMap;
use std::fmt;

/// What starts every sealed response: never the first bytes of a plaintext
/// header block (a header count of 0x49475331 is far above any bound).
pub const MAGIC: &[u8; 4] = b"IGS1";

/// Key ids: short, printable, safe in a log line and a SQL column.
const MAX_ID_LEN: usize = 16;

/// A malformed key list: names the entry (its position and, when readable,
/// its id), never the key material.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyListError {
    #[error("IDEMGATE_STORE_ENCRYPTION_KEYS is set but lists no key")]
    Empty,
    #[error("IDEMGATE_STORE_ENCRYPTION_KEYS entry {0}: expected ID:BASE64")]
    Shape(usize),
    #[error("IDEMGATE_STORE_ENCRYPTION_KEYS entry {0}: the id must be 1 to 16 of A-Z a-z 0-9 _ -")]
    Id(usize),
    #[error("IDEMGATE_STORE_ENCRYPTION_KEYS entry {0} (id {1:?}): the key is not valid base64")]
    Base64(usize, String),
    #[error("IDEMGATE_STORE_ENCRYPTION_KEYS entry {0} (id {1:?}): the key is {2} bytes, a 256-bit key is 32")]
    Length(usize, String, usize),
    #[error("IDEMGATE_STORE_ENCRYPTION_KEYS entry {0}: id {1:?} is listed twice")]
    Duplicate(usize, String),
}

/// Why a sealed response did not open. Either way the record is never
/// executed again: its retries are told it cannot be replayed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OpenError {
    #[error("sealed under key id {0:?}, which is not configured")]
    UnknownKey(String),
    #[error("sealed response is malformed")]
    Malformed,
    #[error("sealed response under key id {0:?} failed authentication (tampered, moved, or another key with that id)")]
    Forged(String),
    /// Never sealed, where `store.plaintext_responses = "refuse"`.
    #[error("stored response is not sealed, and store.plaintext_responses = \"refuse\"")]
    Plaintext,
}

/// The keys: the first seals, every one opens.
pub struct KeyRing {
    current: String,
    keys: HashMap<String, LessSafeKey>,
    rng: SystemRandom,
}

impl fmt::Debug for KeyRing {
    // Key material never reaches a log or a panic message.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut ids: Vec<&String> = self.keys.keys().collect();
        ids.sort();
        f.debug_struct("KeyRing")
            .field("current", &self.current)
            .field("ids", &ids)
            .finish()
    }
}

/// What a response is sealed for: the record it belongs to.
#[derive(Clone, Copy, Debug)]
pub struct Binding<'a> {
    pub scope: &'a [u8; 32],
    pub key: &'a [u8; 32],
    pub status: u16,
}

impl Binding<'_> {
    fn aad(&self) -> [u8; 66] {
        let mut aad = [0u8; 66];
        aad[..32].copy_from_slice(self.scope);
        aad[32..64].copy_from_slice(self.key);
        aad[64..].copy_from_slice(&self.status.to_be_bytes());
        aad
    }
}

impl KeyRing {
    /// Parses `ID:BASE64,ID:BASE64,...` (standard or URL-safe base64,
    /// padded or not; spaces around entries ignored).
    pub fn parse(list: &str) -> Result<Self, KeyListError> {
        let mut keys = HashMap::new();
        let mut current = None;
        for (i, entry) in list.split(',').map(str::trim).enumerate() {
            let n = i + 1;
            if entry.is_empty() {
                continue;
            }
            let (id, material) = entry.split_once(':').ok_or(KeyListError::Shape(n))?;
            let id = id.trim();
            let id_ok = !id.is_empty()
                && id.len() <= MAX_ID_LEN
                && id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if !id_ok {
                return Err(KeyListError::Id(n));
            }
            let bytes = decode_base64(material.trim())
                .ok_or_else(|| KeyListError::Base64(n, id.to_string()))?;
            if bytes.len() != 32 {
                return Err(KeyListError::Length(n, id.to_string(), bytes.len()));
            }
            let key = UnboundKey::new(&AES_256_GCM, &bytes).expect("a 32-byte AES-256 key");
            if keys.insert(id.to_string(), LessSafeKey::new(key)).is_some() {
                return Err(KeyListError::Duplicate(n, id.to_string()));
            }
            current.get_or_insert_with(|| id.to_string());
        }
        let current = current.ok_or(KeyListError::Empty)?;
        Ok(Self {
            current,
            keys,
            rng: SystemRandom::new(),
        })
    }

    /// The id new records are sealed under.
    pub fn current_id(&self) -> &str {
        &self.current
    }

    /// How many keys open records.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub fn knows(&self, id: &str) -> bool {
        self.keys.contains_key(id)
    }

    /// Seals `headers` (encoded) and `body` for the record `binding` names.
    pub fn seal(&self, binding: Binding<'_>, headers: &[u8], body: &[u8]) -> Vec<u8> {
        let key = &self.keys[&self.current];
        let mut nonce = [0u8; NONCE_LEN];
        self.rng
            .fill(&mut nonce)
            .expect("the system's random source");
        let header_len = u32::try_from(headers.len()).expect("header block under 4 GiB");
        let mut out = Vec::with_capacity(
            MAGIC.len() + 1 + self.current.len() + NONCE_LEN + 4 + headers.len() + body.len() + 16,
        );
        out.extend_from_slice(MAGIC);
        out.push(self.current.len() as u8);
        out.extend_from_slice(self.current.as_bytes());
        out.extend_from_slice(&nonce);
        let sealed_from = out.len();
        out.extend_from_slice(&header_len.to_be_bytes());
        out.extend_from_slice(headers);
        out.extend_from_slice(body);
        let mut plain = out.split_off(sealed_from);
        key.seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(binding.aad()),
            &mut plain,
        )
        .expect("AES-GCM seals any length a record holds");
        out.extend_from_slice(&plain);
        out
    }

    /// Opens what [`KeyRing::seal`] made for the same record: the encoded
    /// headers and the body, both views of one buffer decrypted in place
    /// (a replay copies the ciphertext once, nothing after).
    pub fn open(
        &self,
        binding: Binding<'_>,
        sealed: &[u8],
    ) -> Result<(bytes::Bytes, bytes::Bytes), OpenError> {
        let (id, nonce, ciphertext) = split(sealed)?;
        let key = self
            .keys
            .get(id)
            .ok_or_else(|| OpenError::UnknownKey(id.to_string()))?;
        let mut buf = ciphertext.to_vec();
        let plain_len = key
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(binding.aad()),
                &mut buf,
            )
            .map_err(|_| OpenError::Forged(id.to_string()))?
            .len();
        buf.truncate(plain_len);
        let (len, rest) = buf.split_first_chunk::<4>().ok_or(OpenError::Malformed)?;
        let header_len = u32::from_be_bytes(*len) as usize;
        if rest.len() < header_len {
            return Err(OpenError::Malformed);
        }
        let plain = bytes::Bytes::from(buf);
        Ok((
            plain.slice(4..4 + header_len),
            plain.slice(4 + header_len..),
        ))
    }
}

/// The key id a sealed response names, without opening it; `None` for
/// bytes that are not sealed (a record written before keys were set).
pub fn sealed_key_id(bytes: &[u8]) -> Option<&str> {
    split(bytes).ok().map(|(id, _, _)| id)
}

/// Whether `bytes` are a sealed response rather than a plaintext header
/// block.
pub fn is_sealed(bytes: &[u8]) -> bool {
    bytes.starts_with(MAGIC)
}

fn split(sealed: &[u8]) -> Result<(&str, [u8; NONCE_LEN], &[u8]), OpenError> {
    let rest = sealed.strip_prefix(MAGIC).ok_or(OpenError::Malformed)?;
    let (&id_len, rest) = rest.split_first().ok_or(OpenError::Malformed)?;
    let id_len = usize::from(id_len);
    if id_len == 0 || id_len > MAX_ID_LEN || rest.len() < id_len + NONCE_LEN {
        return Err(OpenError::Malformed);
    }
    let (id, rest) = rest.split_at(id_len);
    let id = std::str::from_utf8(id).map_err(|_| OpenError::Malformed)?;
    let (nonce, ciphertext) = rest.split_at(NONCE_LEN);
    let nonce: [u8; NONCE_LEN] = nonce.try_into().map_err(|_| OpenError::Malformed)?;
    Ok((id, nonce, ciphertext))
}

fn decode_base64(s: &str) -> Option<Vec<u8>> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD]
        .iter()
        .find_map(|engine| engine.decode(s).ok())
}

/// A ring of `(id, byte)` keys, each 32 copies of its byte, the first
/// current: for unit tests.
#[cfg(test)]
pub(crate) fn test_ring(list: &[(&str, u8)]) -> KeyRing {
    let text: Vec<String> = list
        .iter()
        .map(|(id, b)| {
            format!(
                "{id}:{}",
                base64::engine::general_purpose::STANDARD.encode([*b; 32])
            )
        })
        .collect();
    KeyRing::parse(&text.join(",")).expect("a test key list parses")
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::engine::general_purpose::STANDARD;

    fn key(byte: u8) -> String {
        STANDARD.encode([byte; 32])
    }

    fn bind<'a>(scope: &'a [u8; 32], key: &'a [u8; 32], status: u16) -> Binding<'a> {
        Binding { scope, key, status }
    }

    #[test]
    fn a_key_list_is_parsed_or_refused_naming_the_entry_never_the_key() {
        let ring = KeyRing::parse(&format!("k2:{}, k1:{}", key(2), key(1))).unwrap();
        assert_eq!(ring.current_id(), "k2");
        assert!(ring.knows("k1") && ring.knows("k2") && !ring.knows("k3"));
        let secret = key(7);
        let cases = [
            (String::new(), KeyListError::Empty),
            (" , ".to_string(), KeyListError::Empty),
            (secret.clone(), KeyListError::Shape(1)),
            (format!("k1:{}, :{secret}", key(1)), KeyListError::Id(2)),
            (format!("has space:{secret}"), KeyListError::Id(1)),
            (format!("{}:{secret}", "x".repeat(17)), KeyListError::Id(1)),
            (
                "k1:not*base64".to_string(),
                KeyListError::Base64(1, "k1".into()),
            ),
            (
                format!("k1:{}", STANDARD.encode([1u8; 16])),
                KeyListError::Length(1, "k1".into(), 16),
            ),
            (
                format!("k1:{secret},k1:{}", key(8)),
                KeyListError::Duplicate(2, "k1".into()),
            ),
        ];
        for (list, want) in cases {
            let err = KeyRing::parse(&list).unwrap_err();
            assert_eq!(err, want, "{list:?}");
            assert!(!err.to_string().contains(&secret), "{err}");
        }
        // URL-safe and unpadded forms are the same key.
        let url = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode([0xfb; 32]);
        let std = STANDARD.encode([0xfb; 32]);
        let (a, b) = (
            KeyRing::parse(&format!("a:{url}")).unwrap(),
            KeyRing::parse(&format!("a:{std}")).unwrap(),
        );
        let sealed = a.seal(bind(&[1; 32], &[2; 32], 201), b"h", b"b");
        assert!(b.open(bind(&[1; 32], &[2; 32], 201), &sealed).is_ok());
        assert!(!format!("{a:?}").contains(&url));
    }

    #[test]
    fn a_sealed_response_opens_only_for_its_own_record_and_known_keys() {
        let old = KeyRing::parse(&format!("old:{}", key(1))).unwrap();
        let both = KeyRing::parse(&format!("new:{},old:{}", key(2), key(1))).unwrap();
        let new_only = KeyRing::parse(&format!("new:{}", key(2))).unwrap();
        let impostor = KeyRing::parse(&format!("old:{}", key(9))).unwrap();
        let (scope, k) = ([3u8; 32], [4u8; 32]);
        let body = b"{\"id\":\"ord_1\",\"card\":\"4242\"}";
        let sealed = old.seal(bind(&scope, &k, 201), b"headers", body);
        assert!(is_sealed(&sealed));
        assert_eq!(sealed_key_id(&sealed), Some("old"));
        assert!(
            !sealed.windows(4).any(|w| w == b"4242"),
            "no byte run of the body survives"
        );
        // Every listed key opens; only the first seals.
        assert_eq!(
            both.open(bind(&scope, &k, 201), &sealed).unwrap(),
            (
                bytes::Bytes::from_static(b"headers"),
                bytes::Bytes::from_static(body)
            )
        );
        assert_eq!(
            sealed_key_id(&both.seal(bind(&scope, &k, 201), b"", b"")),
            Some("new")
        );
        // (ring, binding, bytes) -> error
        let mut tampered = sealed.clone();
        *tampered.last_mut().unwrap() ^= 1;
        let other_key = [5u8; 32];
        let cases: [(&KeyRing, Binding, &[u8], OpenError); 7] = [
            (
                &new_only,
                bind(&scope, &k, 201),
                &sealed,
                OpenError::UnknownKey("old".into()),
            ),
            (
                &impostor,
                bind(&scope, &k, 201),
                &sealed,
                OpenError::Forged("old".into()),
            ),
            (
                &old,
                bind(&scope, &k, 201),
                &tampered,
                OpenError::Forged("old".into()),
            ),
            // Moved to another key, another scope, or given another status.
            (
                &old,
                bind(&scope, &other_key, 201),
                &sealed,
                OpenError::Forged("old".into()),
            ),
            (
                &old,
                bind(&other_key, &k, 201),
                &sealed,
                OpenError::Forged("old".into()),
            ),
            (
                &old,
                bind(&scope, &k, 200),
                &sealed,
                OpenError::Forged("old".into()),
            ),
            (
                &old,
                bind(&scope, &k, 201),
                &sealed[..10],
                OpenError::Malformed,
            ),
        ];
        for (ring, binding, bytes, want) in cases {
            assert_eq!(ring.open(binding, bytes).unwrap_err(), want);
        }
        // A plaintext header block is never mistaken for a sealed one.
        let plain = 0u32.to_be_bytes();
        assert!(!is_sealed(&plain));
        assert_eq!(sealed_key_id(&plain), None);
    }

    #[test]
    fn two_seals_of_the_same_response_differ() {
        let ring = KeyRing::parse(&format!("k:{}", key(1))).unwrap();
        let b = bind(&[0; 32], &[0; 32], 200);
        assert_ne!(ring.seal(b, b"h", b"x"), ring.seal(b, b"h", b"x"));
    }
}
