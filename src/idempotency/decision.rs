//! What to do with a request, given what the store said, and what to do with
//! the upstream's answer. Pure functions with table tests.

use super::{Fingerprint, KeyReuse, Record, RecordState, StoredResponse, UnixMillis};
use std::fmt;
use std::str::FromStr;

/// What a request with a key gets when its claim found a live record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Completed with the same fingerprint: replay it (IETF draft §2.6).
    Replay(StoredResponse),
    /// Another request holds the lease: 409 with `Retry-After` (§2.7).
    InFlight { retry_after_secs: u64 },
    /// Same key, different request: 422 (§2.7), saying when and for what
    /// the key was first used.
    Mismatch(KeyReuse),
    /// Executed, but its response was too large to keep: a definite error,
    /// never a second execution.
    NotReplayable { status: u16 },
    /// Sent upstream with no answer, on a route that keeps such keys: it
    /// may have executed, so it never runs again until an operator says.
    OutcomeUnknown,
}

/// Interprets the record a claim found. The fingerprint is checked first:
/// a different request learns nothing about the original's state, only
/// when and for what its key was first used (in its own scope: a record
/// is keyed by scope, so another client's request never finds it).
pub fn decide(existing: Record, fingerprint: &Fingerprint, now: UnixMillis) -> Decision {
    if existing.fingerprint != *fingerprint {
        return Decision::Mismatch(KeyReuse {
            first_used_at: existing.created_at,
            first_use: existing.first_use,
        });
    }
    match existing.state {
        RecordState::Completed(resp) => Decision::Replay(resp),
        RecordState::Unstored { status } => Decision::NotReplayable { status },
        RecordState::Unknown => Decision::OutcomeUnknown,
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

/// `Retry-After` for a 409 before a route has an observed latency: most
/// protected calls finish within a second or two, and an SDK that honours
/// the header (Stainless, stripe-node) should not sleep for the whole lease.
pub const DEFAULT_RETRY_AFTER_SECS: u64 = 1;

/// `Retry-After` for a 409: when the answer is likely ready. `lease_secs`
/// is what the record says (seconds until its lease runs out, at least 1),
/// `typical` the route's usual upstream latency. A client that honours the
/// header comes back after about one execution (1 s before any was seen),
/// never later than the lease (when a dead holder's key can be taken
/// over) and never before 1 s.
pub fn retry_after_hint(lease_secs: u64, typical: Option<std::time::Duration>) -> u64 {
    let lease_secs = lease_secs.max(1);
    let secs = match typical {
        None => DEFAULT_RETRY_AFTER_SECS,
        Some(t) => (t.as_millis() as u64).div_ceil(1000),
    };
    secs.clamp(1, lease_secs)
}

/// What to do with the key once the upstream answered with `status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settlement {
    /// The request's own outcome (a 4xx such as 404 or 422 was its fault,
    /// and it stays so on a retry). Store it.
    Store,
    /// An answer that means "not executed" (the route's `release_statuses`):
    /// release the key so a retry runs again.
    Release,
}

/// Stores every answer except those the route lists as "not executed".
pub fn settle(status: u16, release: &ReleaseStatuses) -> Settlement {
    if release.contains(status) {
        Settlement::Release
    } else {
        Settlement::Store
    }
}

/// The upstream answers after which a route releases its key: those that
/// mean the request did not execute, so storing them would refuse the
/// retry that should run (a `429 Retry-After: 1` replayed for a day).
/// Only 4xx and 5xx can be listed: a 1xx, 2xx or 3xx answer means the
/// upstream executed the request, and releasing its key would run it twice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReleaseStatuses(Vec<StatusEntry>);

/// One entry of [`ReleaseStatuses`]: a status (`"429"`) or a class (`"5xx"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatusEntry {
    Status(u16),
    /// The first digit: 4 or 5.
    Class(u16),
}

impl ReleaseStatuses {
    /// Checks a whole list: entries may not repeat, nor list a status its
    /// class already covers. An empty list stores every answer.
    pub fn new(entries: Vec<StatusEntry>) -> Result<Self, String> {
        for (i, entry) in entries.iter().enumerate() {
            if let Some(earlier) = entries[..i].iter().find(|e| e.overlaps(entry)) {
                return Err(if earlier == entry {
                    format!("\"{entry}\" is listed twice")
                } else {
                    format!("\"{entry}\" and \"{earlier}\" overlap; keep one")
                });
            }
        }
        Ok(Self(entries))
    }

    pub fn contains(&self, status: u16) -> bool {
        self.0.iter().any(|e| e.contains(status))
    }

    /// This list and those of `statuses` it does not cover yet, in order.
    pub fn adding(mut self, statuses: &[u16]) -> Self {
        for &status in statuses {
            if !self.contains(status) {
                self.0.push(StatusEntry::Status(status));
            }
        }
        self.0.sort_by_key(|e| match *e {
            StatusEntry::Status(s) => s,
            StatusEntry::Class(c) => c * 100,
        });
        self
    }
}

/// 408 (the server gave up waiting for the request), 425 (too early to
/// process), 429 (rate limited) and every 5xx: the answers Stripe saves
/// no result for, because the request never started executing.
impl Default for ReleaseStatuses {
    fn default() -> Self {
        Self(vec![
            StatusEntry::Status(408),
            StatusEntry::Status(425),
            StatusEntry::Status(429),
            StatusEntry::Class(5),
        ])
    }
}

/// As the config writes it: `408,425,429,5xx`, or `none`.
impl fmt::Display for ReleaseStatuses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        let entries: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&entries.join(","))
    }
}

impl StatusEntry {
    fn contains(self, status: u16) -> bool {
        match self {
            StatusEntry::Status(s) => s == status,
            StatusEntry::Class(c) => status / 100 == c,
        }
    }

    fn overlaps(&self, other: &Self) -> bool {
        match (*self, *other) {
            (StatusEntry::Status(a), b) | (b, StatusEntry::Status(a)) => b.contains(a),
            (StatusEntry::Class(a), StatusEntry::Class(b)) => a == b,
        }
    }
}

impl FromStr for StatusEntry {
    type Err = String;

    /// `"429"` or `"5xx"`, strictly: three characters, 4xx or 5xx only.
    fn from_str(s: &str) -> Result<Self, String> {
        let executed = |what: &str| {
            format!(
                "{s:?}: a {what} answer means the upstream executed the request; releasing its key would run it again on retry (only 4xx and 5xx statuses can be listed)"
            )
        };
        let expected =
            || format!("{s:?}: expected a status such as \"429\" or a class \"4xx\" or \"5xx\"");
        let b = s.as_bytes();
        if b.len() != 3 || !b[0].is_ascii_digit() {
            return Err(expected());
        }
        let class = u16::from(b[0] - b'0');
        if &b[1..] == b"xx" {
            return match class {
                4 | 5 => Ok(StatusEntry::Class(class)),
                1..=3 => Err(executed(s)),
                _ => Err(expected()),
            };
        }
        // Three characters, the first a digit: only digits parse.
        let status: u16 = s.parse().map_err(|_| expected())?;
        match class {
            4 | 5 => Ok(StatusEntry::Status(status)),
            1..=3 => Err(executed(&format!("{class}xx"))),
            _ => Err(expected()),
        }
    }
}

impl fmt::Display for StatusEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StatusEntry::Status(s) => write!(f, "{s}"),
            StatusEntry::Class(c) => write!(f, "{c}xx"),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn retry_after_follows_the_route_latency_within_the_lease() {
        use std::time::Duration;
        let ms = Duration::from_millis;
        // (lease seconds left, typical latency, want)
        let cases = [
            // Nothing observed yet: about a second, not the lease.
            (30, None, 1),
            (30, Some(ms(1)), 1),
            (30, Some(ms(900)), 1),
            (30, Some(ms(1000)), 1),
            (30, Some(ms(1001)), 2),
            (30, Some(ms(4500)), 5),
            (3, Some(ms(10_000)), 3),
            (1, Some(ms(60_000)), 1),
            (0, None, 1),
            (0, Some(ms(5000)), 1),
        ];
        for (lease, typical, want) in cases {
            assert_eq!(
                retry_after_hint(lease, typical),
                want,
                "{lease} {typical:?}"
            );
        }
    }

    use super::*;
    use crate::idempotency::FirstUse;
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
            created_at: 4_000,
            expires_at: 1_000_000,
            first_use: Some(FirstUse::new("POST", "/payments")),
        }
    }

    #[test]
    fn decision_table() {
        let same = Fingerprint([1; 32]);
        let now = 10_000;
        let in_flight = |fp, from_now| {
            record(
                fp,
                RecordState::InFlight {
                    locked_until: now + from_now,
                },
            )
        };
        let retry = |retry_after_secs| Decision::InFlight { retry_after_secs };
        // Whatever the record's state: only when and for what.
        let mismatch = Decision::Mismatch(KeyReuse {
            first_used_at: 4_000,
            first_use: Some(FirstUse::new("POST", "/payments")),
        });
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
                mismatch.clone(),
            ),
            (in_flight(1, 29_001), retry(30)),
            (in_flight(1, 1), retry(1)),
            // A lease that ran out between claim and read still says "retry soon".
            (in_flight(1, -5), retry(1)),
            (in_flight(2, 5_000), mismatch.clone()),
            // A dead holder's key: the same answer, no hint that it is abandoned.
            (in_flight(2, -5), mismatch.clone()),
            (
                record(1, RecordState::Unstored { status: 200 }),
                Decision::NotReplayable { status: 200 },
            ),
            (
                record(2, RecordState::Unstored { status: 200 }),
                mismatch.clone(),
            ),
            (record(1, RecordState::Unknown), Decision::OutcomeUnknown),
            (record(2, RecordState::Unknown), mismatch),
            // A record written before first uses were kept: the time alone.
            (
                Record {
                    first_use: None,
                    ..record(2, RecordState::Completed(resp(201)))
                },
                Decision::Mismatch(KeyReuse {
                    first_used_at: 4_000,
                    first_use: None,
                }),
            ),
        ];
        for (i, (rec, want)) in cases.into_iter().enumerate() {
            assert_eq!(decide(rec, &same, now), want, "case {i}");
        }
    }

    fn list(entries: &[&str]) -> Result<ReleaseStatuses, String> {
        ReleaseStatuses::new(entries.iter().map(|e| e.parse().unwrap()).collect())
    }

    fn statuses(entries: &[&str]) -> ReleaseStatuses {
        list(entries).unwrap()
    }

    #[test]
    fn settlement_table() {
        let default = ReleaseStatuses::default();
        let only_5xx = statuses(&["5xx"]);
        let none = statuses(&[]);
        let both_classes = statuses(&["4xx", "5xx"]);
        let store = Settlement::Store;
        let release = Settlement::Release;
        // status, default (408, 425, 429, 5xx), ["5xx"], [], ["4xx", "5xx"]
        for (status, want) in [
            (200, [store, store, store, store]),
            (201, [store, store, store, store]),
            (302, [store, store, store, store]),
            (400, [store, store, store, release]),
            (404, [store, store, store, release]),
            (408, [release, store, store, release]),
            (409, [store, store, store, release]),
            (422, [store, store, store, release]),
            (425, [release, store, store, release]),
            (429, [release, store, store, release]),
            (499, [store, store, store, release]),
            (500, [release, release, store, release]),
            (503, [release, release, store, release]),
            (599, [release, release, store, release]),
            // Not an HTTP status (RFC 9110 §15 stops at 599): no class covers it.
            (600, [store, store, store, store]),
        ] {
            for (set, want) in [&default, &only_5xx, &none, &both_classes]
                .into_iter()
                .zip(want)
            {
                assert_eq!(settle(status, set), want, "{status} with [{set}]");
            }
        }
    }

    #[test]
    fn release_entries_are_strict() {
        for (ok, want) in [
            ("408", StatusEntry::Status(408)),
            ("599", StatusEntry::Status(599)),
            ("4xx", StatusEntry::Class(4)),
            ("5xx", StatusEntry::Class(5)),
        ] {
            assert_eq!(ok.parse::<StatusEntry>(), Ok(want), "{ok}");
        }
        for (bad, needle) in [
            ("200", "executed the request"),
            ("2xx", "executed the request"),
            ("1xx", "executed the request"),
            ("301", "executed the request"),
            ("100", "executed the request"),
            ("600", "expected a status"),
            ("6xx", "expected a status"),
            ("099", "expected a status"),
            ("5XX", "expected a status"),
            ("5x", "expected a status"),
            ("4291", "expected a status"),
            (" 429", "expected a status"),
            ("+29", "expected a status"),
            ("", "expected a status"),
            ("x5x", "expected a status"),
        ] {
            let err = bad.parse::<StatusEntry>().unwrap_err();
            assert!(err.contains(needle), "{bad:?}: {err}");
        }
        assert!(list(&["429", "429"]).unwrap_err().contains("listed twice"));
        assert!(list(&["5xx", "503"]).unwrap_err().contains("overlap"));
        assert!(list(&["503", "5xx"]).unwrap_err().contains("overlap"));
        assert!(list(&["4xx", "4xx"]).unwrap_err().contains("listed twice"));
        assert_eq!(
            list(&["408", "425", "429", "5xx"]),
            Ok(ReleaseStatuses::default())
        );
        assert_eq!(ReleaseStatuses::default().to_string(), "408,425,429,5xx");
        assert_eq!(list(&[]).unwrap().to_string(), "none");
    }

    /// A delivery route's refusals join its list, in order, without
    /// repeating what a class already covers.
    #[test]
    fn adding_statuses_keeps_the_list_ordered_and_without_overlaps() {
        for (base, want) in [
            (
                &["408", "425", "429", "5xx"][..],
                "400,401,403,404,408,425,429,5xx",
            ),
            (&["5xx"][..], "400,401,403,404,5xx"),
            (&[][..], "400,401,403,404"),
            (&["4xx", "5xx"][..], "4xx,5xx"),
            (&["401", "429"][..], "400,401,403,404,429"),
        ] {
            let added = statuses(base).adding(&[400, 401, 403, 404]);
            assert_eq!(added.to_string(), want, "{base:?}");
            assert_eq!(
                ReleaseStatuses::new(added.0.clone()),
                Ok(added.clone()),
                "{base:?}: still a valid list"
            );
        }
    }
}
