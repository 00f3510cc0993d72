//! The Redis fast path's value layout (locks, completed and unstored
//! records). Decoding any bytes never panics; a value that decodes is the
//! canonical encoding of what it decodes to (so the Lua scripts' byte
//! offsets hold for it); and every cacheable record and every lock
//! round-trip, with or without a first use.
#![no_main]

use bytes::Bytes;
use idemgate::fuzzing::{redis_decode, redis_encode_lock, redis_encode_record, Cached};
use idemgate::idempotency::{Fingerprint, Record, RecordKey, RecordState, Scope, StoredResponse};
use idemgate::store::{Claim, FirstUse, LeaseToken};
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|raw: &[u8]| {
    match redis_decode(raw) {
        Ok(Cached::Record(record)) => {
            assert_eq!(redis_encode_record(&record).as_deref(), Some(raw));
        }
        Ok(Cached::Lock {
            token,
            fingerprint,
            created_at,
            expires_at,
            first_use,
        }) => {
            if let Some(ttl_ms) = expires_at.checked_sub(created_at) {
                let claim = Claim {
                    key: RecordKey {
                        scope: Scope([0; 32]),
                        key: [0; 32],
                    },
                    fingerprint,
                    token,
                    now: created_at,
                    lease_ms: 0,
                    ttl_ms,
                    first_use,
                };
                assert_eq!(redis_encode_lock(&claim), raw);
            }
        }
        Err(_) => {}
    }
    let _ = round_trips(&mut Unstructured::new(raw));
});

fn round_trips(u: &mut Unstructured<'_>) -> Result<()> {
    let fingerprint = Fingerprint(u.arbitrary()?);
    let (created_at, expires_at): (i64, i64) = (u.arbitrary()?, u.arbitrary()?);
    let status: u16 = u.arbitrary()?;
    let state = match u.int_in_range(0..=3)? {
        0 => {
            let n = u.int_in_range(0..=8)?;
            let headers = (0..n)
                .map(|_| {
                    Ok((
                        u.arbitrary::<String>()?,
                        Bytes::from(u.arbitrary::<Vec<u8>>()?),
                    ))
                })
                .collect::<Result<Vec<_>>>()?;
            RecordState::Completed(StoredResponse {
                status,
                headers,
                body: Bytes::from(u.arbitrary::<Vec<u8>>()?),
            })
        }
        1 => RecordState::Unstored { status },
        2 => RecordState::InFlight {
            locked_until: u.arbitrary()?,
        },
        _ => RecordState::Unknown,
    };
    let cacheable = matches!(
        state,
        RecordState::Completed(_) | RecordState::Unstored { .. }
    );
    let first_use = u
        .arbitrary::<Option<(String, String)>>()?
        .map(|(method, path)| FirstUse::new(&method, &path));
    let record = Record {
        fingerprint,
        state,
        created_at,
        expires_at,
        first_use: first_use.clone(),
    };
    match redis_encode_record(&record) {
        Some(value) => {
            assert!(cacheable);
            assert_eq!(redis_decode(&value).ok(), Some(Cached::Record(record)));
        }
        None => assert!(!cacheable),
    }
    // A lock, with a time that cannot overflow (the caller's clock).
    let now = u.int_in_range(0..=i64::MAX / 4)?;
    let ttl_ms = u.int_in_range(0..=i64::MAX / 4)?;
    let claim = Claim {
        key: RecordKey {
            scope: Scope(u.arbitrary()?),
            key: u.arbitrary()?,
        },
        fingerprint,
        token: LeaseToken(u.arbitrary()?),
        now,
        lease_ms: u.int_in_range(0..=ttl_ms)?,
        ttl_ms,
        first_use: first_use.clone(),
    };
    let value = redis_encode_lock(&claim);
    // The Lua scripts read the token at bytes 50..=65 (1-based).
    assert_eq!(&value[49..65], &claim.token.0);
    assert_eq!(
        redis_decode(&value).ok(),
        Some(Cached::Lock {
            token: claim.token,
            fingerprint,
            created_at: now,
            expires_at: claim.expires_at(),
            first_use,
        })
    );
    Ok(())
}
