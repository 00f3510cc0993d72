//! The layout of the values the fast path keeps in Redis, and its codec
//! (fuzzed through `crate::fuzzing`). Every value starts `tag:u8,
//! created_at:i64, expires_at:i64, fingerprint:[32]` (big-endian), so the
//! Lua scripts ([`super::scripts`]) find the fields at fixed offsets:
//!   lock:      + token:[16]
//!   completed: + status:u16, headers_len:u32, headers, body
//!   unstored:  + status:u16

use crate::idempotency::Fingerprint;
use crate::store::codec::{decode_headers, encode_headers};
use crate::store::{
    Claim, LeaseToken, Record, RecordState, StoreError, StoredResponse, UnixMillis,
};
use bytes::Bytes;

pub(super) const TAG_LOCK: u8 = 1;
const TAG_COMPLETED: u8 = 2;
const TAG_UNSTORED: u8 = 3;
const HEAD_LEN: usize = 1 + 8 + 8 + 32;

/// A decoded Redis value.
#[derive(Debug, PartialEq, Eq)]
pub enum Cached {
    Lock {
        token: LeaseToken,
        fingerprint: Fingerprint,
        created_at: UnixMillis,
        expires_at: UnixMillis,
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

pub(crate) fn encode_lock(claim: &Claim) -> Vec<u8> {
    let mut out = head(
        TAG_LOCK,
        claim.now,
        claim.expires_at(),
        &claim.fingerprint,
        16,
    );
    out.extend_from_slice(&claim.token.0);
    out
}

/// Encodes a completed or unstored record; `None` for in-flight (never cached).
pub(crate) fn encode_record(record: &Record) -> Option<Vec<u8>> {
    let record_head = |tag, extra| {
        head(
            tag,
            record.created_at,
            record.expires_at,
            &record.fingerprint,
            extra,
        )
    };
    match &record.state {
        // Outcome-unknown records are rare and answered by the inner store.
        RecordState::InFlight { .. } | RecordState::Unknown => None,
        RecordState::Completed(resp) => {
            let headers = encode_headers(&resp.headers);
            let mut out = record_head(TAG_COMPLETED, 6 + headers.len() + resp.body.len());
            out.extend_from_slice(&resp.status.to_be_bytes());
            out.extend_from_slice(&(headers.len() as u32).to_be_bytes());
            out.extend_from_slice(&headers);
            out.extend_from_slice(&resp.body);
            Some(out)
        }
        RecordState::Unstored { status } => {
            let mut out = record_head(TAG_UNSTORED, 2);
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
    let rest = &buf[HEAD_LEN..];
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
        })
    };
    match buf[0] {
        TAG_LOCK => {
            let token: [u8; 16] = rest.try_into().map_err(|_| corrupt("bad lock"))?;
            Ok(Cached::Lock {
                token: LeaseToken(token),
                fingerprint,
                created_at,
                expires_at,
            })
        }
        TAG_COMPLETED => {
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
        TAG_UNSTORED if rest.len() == 2 => Ok(record(RecordState::Unstored { status: status()? })),
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
        assert_eq!(
            decode(&v).unwrap(),
            Cached::Lock {
                token: c.token,
                fingerprint: c.fingerprint,
                created_at: c.now,
                expires_at: c.expires_at(),
            }
        );
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
        };
        let unstored = Record {
            state: RecordState::Unstored { status: 200 },
            ..completed.clone()
        };
        for r in [completed, unstored] {
            let v = encode_record(&r).unwrap();
            assert_eq!(decode(&v).unwrap(), Cached::Record(r));
            assert!(decode(&v[..HEAD_LEN + 1]).is_err());
        }
        let in_flight = Record {
            fingerprint: Fingerprint([0; 32]),
            state: RecordState::InFlight { locked_until: 1 },
            created_at: 0,
            expires_at: 1,
        };
        assert_eq!(encode_record(&in_flight), None);
        assert!(decode(b"").is_err());
        assert!(decode(&[7; HEAD_LEN + 2]).is_err());
    }
}
