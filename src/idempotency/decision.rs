//! What to do with a request, given what the store said, and what to do with
//! the upstream's answer. Pure functions with table tests.

use super::{Fingerprint, Record, RecordState, StoredResponse, UnixMillis};

/// What a request with a key gets when its claim found a live record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Completed with the same fingerprint: replay it (IETF draft §2.6).
    Replay(StoredResponse),
    /// Another request holds the lease: 409 with `Retry-After` (§2.7).
    InFlight { retry_after_secs: u64 },
    /// Same key, different request: 422 (§2.7).
    Mismatch,
    /// Executed, but its response was too large to keep: a definite error,
    /// never a second execution.
    NotReplayable { status: u16 },
}

/// Interprets the record a claim found. The fingerprint is checked first:
/// a different request learns nothing about the original's state.
pub fn decide(existing: Record, fingerprint: &Fingerprint, now: UnixMillis) -> Decision {
    if existing.fingerprint != *fingerprint {
        return Decision::Mismatch;
    }
    match existing.state {
        RecordState::Completed(resp) => Decision::Replay(resp),
        RecordState::Unstored { status } => Decision::NotReplayable { status },
        RecordState::InFlight { locked_until } => Decision::InFlight {
            retry_after_secs: retry_after_secs(locked_until, now),
        },
    }
}

/// Seconds until the lease runs out, rounded up, at least 1.
fn retry_after_secs(locked_until: UnixMillis, now: UnixMillis) -> u64 {
    let ms = (locked_until - now).max(0) as u64;
    ms.div_ceil(1000).max(1)
}

/// What to do with the key once the upstream answered with `status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settlement {
    /// Below 500: the request's own outcome (a 4xx was its fault). Store it.
    Store,
    /// 5xx: the server failed; release the key so the retry runs again.
    Release,
}

pub fn settle(status: u16) -> Settlement {
    if status >= 500 {
        Settlement::Release
    } else {
        Settlement::Store
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn resp(status: u16) -> StoredResponse {
        StoredResponse {
            status,
            headers: vec![("location".into(), Bytes::from_static(b"/o/1"))],
            body: Bytes::from_static(b"{}"),
        }
    }

    fn record(fp: u8, state: RecordState) -> Record {
        Record {
            fingerprint: Fingerprint([fp; 32]),
            state,
            created_at: 0,
            expires_at: 1_000_000,
        }
    }

    #[test]
    fn decision_table() {
        let same = Fingerprint([1; 32]);
        let now = 10_000;
        let cases = [
            (
                record(1, RecordState::Completed(resp(201))),
                Decision::Replay(resp(201)),
            ),
            (
                record(1, RecordState::Completed(resp(404))),
                Decision::Replay(resp(404)),
            ),
            (
                record(2, RecordState::Completed(resp(201))),
                Decision::Mismatch,
            ),
            (
                record(
                    1,
                    RecordState::InFlight {
                        locked_until: now + 29_001,
                    },
                ),
                Decision::InFlight {
                    retry_after_secs: 30,
                },
            ),
            (
                record(
                    1,
                    RecordState::InFlight {
                        locked_until: now + 1,
                    },
                ),
                Decision::InFlight {
                    retry_after_secs: 1,
                },
            ),
            (
                // A lease that ran out between claim and read still says "retry soon".
                record(
                    1,
                    RecordState::InFlight {
                        locked_until: now - 5,
                    },
                ),
                Decision::InFlight {
                    retry_after_secs: 1,
                },
            ),
            (
                record(
                    2,
                    RecordState::InFlight {
                        locked_until: now + 5_000,
                    },
                ),
                Decision::Mismatch,
            ),
            (
                record(1, RecordState::Unstored { status: 200 }),
                Decision::NotReplayable { status: 200 },
            ),
            (
                record(2, RecordState::Unstored { status: 200 }),
                Decision::Mismatch,
            ),
        ];
        for (i, (rec, want)) in cases.into_iter().enumerate() {
            assert_eq!(decide(rec, &same, now), want, "case {i}");
        }
    }

    #[test]
    fn settlement_table() {
        for (status, want) in [
            (200, Settlement::Store),
            (201, Settlement::Store),
            (302, Settlement::Store),
            (400, Settlement::Store),
            (422, Settlement::Store),
            (499, Settlement::Store),
            (500, Settlement::Release),
            (503, Settlement::Release),
            (599, Settlement::Release),
        ] {
            assert_eq!(settle(status), want, "{status}");
        }
    }
}
