//! The layout of the values the fast path keeps in Redis, and its codec
//! (fuzzed through `crate::fuzzing`). Every value starts `tag:u8,
//! created_at:i64, expires_at:i64, fingerprint:[32]` (big-endian), so the
//! Lua scripts ([`super::scripts`]) find the fields at fixed offsets:
//!   lock (1):      + token:[16] [+ first use]
//!   completed (4): + first use, status:u16, headers_len:u32, headers, body
//!   unstored (5):  + first use, status:u16
//! where "first use" is `method_len:u8, method, path_len:u16, path`
//! ([`FirstUse`]). The tag versions the layout: a completed (2) or
//! unstored (3) value without the first use is what earlier versions
//! wrote, and is still read (and written for a record that has none), so
//! their copies keep answering; a value this version writes with a first
//! use has a tag they do not know, which they treat as no copy at all
//! (the inner store answers).

use crate::idempotency::Fingerprint;
use crate::store::codec::{decode_headers, encode_headers};
use crate::store::{
    Claim, FirstUse, LeaseToken, Record, RecordState, StoreError, StoredResponse, UnixMillis,
};
use bytes::Bytes;

pub(super) const TAG_LOCK: u8 = 1;
/// Completed and unstored, without a first use (the first layout).
const TAG_COMPLETED_PLAIN: u8 = 2;
const TAG_UNSTORED_PLAIN: u8 = 3;
/// Completed and unstored, with the first use after the head.
const TAG_COMPLETED: u8 = 4;
const TAG_UNSTORED: u8 = 5;
const HEAD_LEN: usize = 1 + 8 + 8 + 32;
const TOKEN_LEN: usize = 16;

/// A decoded Redis value.
#[derive(Debug, PartialEq, Eq)]
pub enum Cached {
    Lock {
        token: LeaseToken,
        fingerprint: Fingerprint,
        created_at: UnixMillis,
        expires_at: UnixMillis,
        first_use: Option<FirstUse>,
    },
    Record(Record),
}

fn head(tag: u8, created_at: i64, expires_at: i64, fp: &Fingerprint, extra: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEAD_LEN + extra);
    out.push(tag);
    out.extend_from_slice(&created_at.to_be_bytes());
    out.extend_from_slice(&expires_at.to_be_bytes());
    out.extend_from_slice(&fp.0);
    out
}

fn first_use_len(first: &FirstUse) -> usize {
    1 + first.method.len() + 2 + first.path.len()
}

/// Appends `first`. Its parts are bounded far below their length fields
/// ([`crate::idempotency::record::MAX_FIRST_PATH_BYTES`]); cut to them
/// anyway, so no value can be misread.
fn encode_first_use(first: &FirstUse, out: &mut Vec<u8>) {
    let method = &first.method.as_bytes()[..first.method.len().min(usize::from(u8::MAX))];
    let path = &first.path.as_bytes()[..first.path.len().min(usize::from(u16::MAX))];
    out.push(method.len() as u8);
    out.extend_from_slice(method);
    out.extend_from_slice(&(path.len() as u16).to_be_bytes());
    out.extend_from_slice(path);
}

/// A first use at the start of `buf`, and what follows it.
fn decode_first_use(buf: &[u8]) -> Result<(FirstUse, &[u8]), StoreError> {
    let corrupt = || StoreError::Corrupt("redis value: truncated first use".into());
    let text = |bytes: &[u8]| {
        std::str::from_utf8(bytes)
            .map(str::to_string)
            .map_err(|_| StoreError::Corrupt("redis value: first use is not UTF-8".into()))
    };
    let (&method_len, rest) = buf.split_first().ok_or_else(corrupt)?;
    let method = rest.get(..usize::from(method_len)).ok_or_else(corrupt)?;
    let rest = &rest[usize::from(method_len)..];
    let path_len = rest
        .get(..2)
        .map(|s| usize::from(u16::from_be_bytes([s[0], s[1]])))
        .ok_or_else(corrupt)?;
    let path = rest.get(2..2 + path_len).ok_or_else(corrupt)?;
    let first = FirstUse {
        method: text(method)?,
        path: text(path)?,
    };
    Ok((first, &rest[2 + path_len..]))
}

pub(crate) fn encode_lock(claim: &Claim) -> Vec<u8> {
    let first = claim.first_use.as_ref();
    let mut out = head(
        TAG_LOCK,
        claim.now,
        claim.expires_at(),
        &claim.fingerprint,
        TOKEN_LEN + first.map_or(0, first_use_len),
    );
    out.extend_from_slice(&claim.token.0);
    if let Some(first) = first {
        encode_first_use(first, &mut out);
    }
    out
}

/// The tag a completion's value gets when the lock it replaces carries a
/// first use (`COMPLETE_LUA` moves the first use over): `tag` is the tag
/// [`encode_record`] gave the value, which has none.
pub(crate) fn with_first_use(tag: u8) -> u8 {
    match tag {
        TAG_COMPLETED_PLAIN => TAG_COMPLETED,
        TAG_UNSTORED_PLAIN => TAG_UNSTORED,
        other => other,
    }
}

/// Encodes a completed or unstored record; `None` for in-flight (never cached).
pub(crate) fn encode_record(record: &Record) -> Option<Vec<u8>> {
    let first = record.first_use.as_ref();
    let record_head = |plain, tagged, extra| {
        let tag = if first.is_some() { tagged } else { plain };
        let mut out = head(
            tag,
            record.created_at,
            record.expires_at,
            &record.fingerprint,
            extra + first.map_or(0, first_use_len),
        );
        if let Some(first) = first {
            encode_first_use(first, &mut out);
        }
        out
    };
    match &record.state {
        // Outcome-unknown records are rare and answered by the inner store.
        RecordState::InFlight { .. } | RecordState::Unknown => None,
        RecordState::Completed(resp) => {
            let headers = encode_headers(&resp.headers);
            let extra = 6 + headers.len() + resp.body.len();
            let mut out = record_head(TAG_COMPLETED_PLAIN, TAG_COMPLETED, extra);
            out.extend_from_slice(&resp.status.to_be_bytes());
            out.extend_from_slice(&(headers.len() as u32).to_be_bytes());
            out.extend_from_slice(&headers);
            out.extend_from_slice(&resp.body);
            Some(out)
        }
        RecordState::Unstored { status } => {
            let mut out = record_head(TAG_UNSTORED_PLAIN, TAG_UNSTORED, 2);
            out.extend_from_slice(&status.to_be_bytes());
            Some(out)
        }
    }
}

pub(crate) fn decode(buf: &[u8]) -> Result<Cached, StoreError> {
    let corrupt = |what: &str| StoreError::Corrupt(format!("redis value: {what}"));
    if buf.len() < HEAD_LEN {
        return Err(corrupt("truncated"));
    }
    let i64_at = |at: usize| i64::from_be_bytes(buf[at..at + 8].try_into().expect("8 bytes"));
    let created_at = i64_at(1);
    let expires_at = i64_at(9);
    let fingerprint = Fingerprint(buf[17..HEAD_LEN].try_into().expect("32 bytes"));
    let (first_use, rest) = match buf[0] {
        TAG_COMPLETED | TAG_UNSTORED => {
            let (first, rest) = decode_first_use(&buf[HEAD_LEN..])?;
            (Some(first), rest)
        }
        _ => (None, &buf[HEAD_LEN..]),
    };
    let status = || -> Result<u16, StoreError> {
        rest.get(..2)
            .map(|s| u16::from_be_bytes([s[0], s[1]]))
            .ok_or_else(|| corrupt("no status"))
    };
    let record = |state| {
        Cached::Record(Record {
            fingerprint,
            state,
            created_at,
            expires_at,
            first_use: first_use.clone(),
        })
    };
    match buf[0] {
        TAG_LOCK => {
            let token: [u8; TOKEN_LEN] = rest
                .get(..TOKEN_LEN)
                .and_then(|t| t.try_into().ok())
                .ok_or_else(|| corrupt("bad lock"))?;
            // A lock written before locks carried the first use ends here.
            let first_use = match &rest[TOKEN_LEN..] {
                [] => None,
                block => match decode_first_use(block)? {
                    (first, []) => Some(first),
                    _ => return Err(corrupt("bad lock")),
                },
            };
            Ok(Cached::Lock {
                token: LeaseToken(token),
                fingerprint,
                created_at,
                expires_at,
                first_use,
            })
        }
        TAG_COMPLETED_PLAIN | TAG_COMPLETED => {
            let status = status()?;
            let hlen = rest
                .get(2..6)
                .map(|s| u32::from_be_bytes([s[0], s[1], s[2], s[3]]) as usize)
                .ok_or_else(|| corrupt("no header length"))?;
            let headers = rest
                .get(6..6 + hlen)
                .ok_or_else(|| corrupt("truncated headers"))?;
            Ok(record(RecordState::Completed(StoredResponse {
                status,
                headers: decode_headers(headers)?,
                body: Bytes::copy_from_slice(&rest[6 + hlen..]),
            })))
        }
        TAG_UNSTORED_PLAIN | TAG_UNSTORED if rest.len() == 2 => {
            Ok(record(RecordState::Unstored { status: status()? }))
        }
        _ => Err(corrupt("unknown tag")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sample_claim as claim;

    #[test]
    fn lock_layout_matches_the_lua_offsets() {
        let c = claim();
        let v = encode_lock(&c);
        assert_eq!(v[0], TAG_LOCK);
        // Lua's string.sub(v, 50, 65) is bytes 49..65 here.
        assert_eq!(&v[49..65], &c.token.0);
        // Lua's string.sub(v, 2, 9) and (18, 49): created_at and fingerprint.
        assert_eq!(&v[1..9], &c.now.to_be_bytes());
        assert_eq!(&v[17..49], &c.fingerprint.0);
        // Lua's string.sub(v, 66): the first use, which COMPLETE_LUA moves
        // into the completed value right after its head.
        let mut first = Vec::new();
        encode_first_use(c.first_use.as_ref().unwrap(), &mut first);
        assert_eq!(&v[65..], &first[..]);
        assert_eq!(
            decode(&v).unwrap(),
            Cached::Lock {
                token: c.token,
                fingerprint: c.fingerprint,
                created_at: c.now,
                expires_at: c.expires_at(),
                first_use: c.first_use.clone(),
            }
        );
        let anonymous = Claim {
            first_use: None,
            ..c
        };
        assert_eq!(encode_lock(&anonymous).len(), HEAD_LEN + TOKEN_LEN);
    }

    /// What `COMPLETE_LUA` builds from a lock with a first use and the
    /// value `encode_record` gave the completion, in Rust: the record as
    /// `encode_record` would write it with the lock's first use.
    #[test]
    fn a_completion_over_a_lock_gets_the_lock_s_first_use() {
        let c = claim();
        let lock = encode_lock(&c);
        for state in [
            RecordState::Unstored { status: 200 },
            RecordState::Completed(StoredResponse {
                status: 201,
                headers: vec![("x-a".into(), Bytes::from_static(b"1"))],
                body: Bytes::from_static(b"body"),
            }),
        ] {
            let placeholder = Record {
                fingerprint: Fingerprint([0; 32]),
                state: state.clone(),
                created_at: 0,
                expires_at: 0,
                first_use: None,
            };
            let completion = encode_record(&placeholder).unwrap();
            let expires_at = c.expires_at();
            let mut lua = vec![with_first_use(completion[0])];
            lua.extend_from_slice(&lock[1..9]);
            lua.extend_from_slice(&expires_at.to_be_bytes());
            lua.extend_from_slice(&lock[17..49]);
            lua.extend_from_slice(&lock[65..]);
            lua.extend_from_slice(&completion[49..]);
            let want = Record {
                fingerprint: c.fingerprint,
                state,
                created_at: c.now,
                expires_at,
                first_use: c.first_use.clone(),
            };
            assert_eq!(lua, encode_record(&want).unwrap());
            assert_eq!(decode(&lua).unwrap(), Cached::Record(want));
        }
    }

    #[test]
    fn records_round_trip_and_garbage_is_corrupt() {
        let completed = Record {
            fingerprint: Fingerprint([9; 32]),
            state: RecordState::Completed(StoredResponse {
                status: 201,
                headers: vec![
                    ("x-a".into(), Bytes::from_static(b"1")),
                    ("x-a".into(), Bytes::from_static(b"\xff")),
                ],
                body: Bytes::from_static(b"\x00body\xff"),
            }),
            created_at: 5,
            expires_at: 6,
            first_use: Some(FirstUse::new("POST", "/payments/é")),
        };
        let unstored = Record {
            state: RecordState::Unstored { status: 200 },
            ..completed.clone()
        };
        let plain = |r: &Record| Record {
            first_use: None,
            ..r.clone()
        };
        for r in [plain(&completed), plain(&unstored), completed, unstored] {
            let v = encode_record(&r).unwrap();
            assert_eq!(decode(&v).unwrap(), Cached::Record(r));
            assert!(decode(&v[..HEAD_LEN + 1]).is_err());
        }
        let in_flight = Record {
            fingerprint: Fingerprint([0; 32]),
            state: RecordState::InFlight { locked_until: 1 },
            created_at: 0,
            expires_at: 1,
            first_use: None,
        };
        assert_eq!(encode_record(&in_flight), None);
        assert!(decode(b"").is_err());
        assert!(decode(&[7; HEAD_LEN + 2]).is_err());
        let mut lock = encode_lock(&claim());
        lock.push(0);
        assert!(decode(&lock).is_err(), "trailing bytes after a lock");
    }

    /// Copies written by the version before first uses (tags 1, 2, 3, laid
    /// out by hand here as it wrote them) still answer, without one.
    #[test]
    fn values_written_by_the_previous_version_still_decode() {
        let old_head = |tag: u8| {
            let mut v = vec![tag];
            v.extend_from_slice(&5i64.to_be_bytes());
            v.extend_from_slice(&6i64.to_be_bytes());
            v.extend_from_slice(&[9; 32]);
            v
        };
        let record = |state| {
            Cached::Record(Record {
                fingerprint: Fingerprint([9; 32]),
                state,
                created_at: 5,
                expires_at: 6,
                first_use: None,
            })
        };
        let headers = encode_headers(&[("x-a".into(), Bytes::from_static(b"1"))]);
        let mut completed = old_head(2);
        completed.extend_from_slice(&201u16.to_be_bytes());
        completed.extend_from_slice(&(headers.len() as u32).to_be_bytes());
        completed.extend_from_slice(&headers);
        completed.extend_from_slice(b"body");
        assert_eq!(
            decode(&completed).unwrap(),
            record(RecordState::Completed(StoredResponse {
                status: 201,
                headers: vec![("x-a".into(), Bytes::from_static(b"1"))],
                body: Bytes::from_static(b"body"),
            }))
        );
        let mut unstored = old_head(3);
        unstored.extend_from_slice(&200u16.to_be_bytes());
        assert_eq!(
            decode(&unstored).unwrap(),
            record(RecordState::Unstored { status: 200 })
        );
        let mut lock = old_head(1);
        lock.extend_from_slice(&[4; 16]);
        assert_eq!(
            decode(&lock).unwrap(),
            Cached::Lock {
                token: LeaseToken([4; 16]),
                fingerprint: Fingerprint([9; 32]),
                created_at: 5,
                expires_at: 6,
                first_use: None,
            }
        );
    }
}
