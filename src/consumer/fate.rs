//! A message's fate: what the broker is told, as a pure function of what
//! its delivery did (README "Message consumers", the fate table).
//!
//! | what happened | the broker is told |
//! |---|---|
//! | executed, 2xx (any status below 400), answer recorded | ack |
//! | executed, a status the consumer stores (4xx, or a 5xx not released), recorded | dead-letter (`rejected`) |
//! | executed, answer not recorded yet (store slow) | come back later, not counted |
//! | a recorded answer found (duplicate, redelivery): below 400 / 400 and up | ack / dead-letter (`rejected`), upstream not called |
//! | released (a release status, refused, or ambiguous with `on_ambiguous = "release"`) | retry after a backoff (`Retry-After` honoured up to `retry_max`), counted; dead-letter (`exhausted`) after `max_attempts` |
//! | parked as outcome unknown (`on_ambiguous = "keep"`) | dead-letter (`outcome_unknown`) for an operator |
//! | in flight elsewhere | come back later (after its `Retry-After`), not counted (JetStream: held and claimed again first, `run.rs`) |
//! | the key was used with a different payload | dead-letter (`mismatch`) |
//! | no key | dead-letter (`no_key`) |
//! | unsettled (store down, lease lost, key locked) | come back later, not counted |

use crate::net::backoff::Backoff;
use std::time::Duration;

/// What one delivery of a message did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Happened {
    /// The upstream ran it and answered `status`, which the consumer
    /// stores; `recorded`: the store confirmed the answer under our lease.
    Executed { status: u16, recorded: bool },
    /// A recorded answer was found: a duplicate or a redelivery of a
    /// message that already ran (the upstream was not called).
    Duplicate { status: u16 },
    /// The key was released without a stored answer: a release status, a
    /// refused connection, or an ambiguous outcome on `on_ambiguous =
    /// "release"`. `retry_after`: the upstream's `Retry-After`.
    Released {
        status: Option<u16>,
        retry_after: Option<Duration>,
    },
    /// Outcome unknown, kept (`on_ambiguous = "keep"`): the key never
    /// runs again until an operator resolves it.
    Parked,
    /// Another delivery (here or on another replica) holds the key.
    InFlight { retry_after: Duration },
    /// The key was first used with a different payload.
    Mismatch,
    /// The message has no usable key.
    NoKey,
    /// Nothing settled: the store did not answer, the lease was lost, or
    /// the answer is still being recorded in doubt. The broker is told to
    /// bring it back; whoever holds the key decides.
    Unsettled,
}

/// Why a message was dead-lettered (a metric label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// A stored answer of 400 or above: retrying would not change it.
    Rejected,
    /// `max_attempts` released attempts.
    Exhausted,
    /// Parked as outcome unknown, for an operator.
    OutcomeUnknown,
    /// Its key was used with a different payload.
    Mismatch,
    /// No usable key.
    NoKey,
}

impl Reason {
    pub const ALL: [Reason; 5] = [
        Reason::Rejected,
        Reason::Exhausted,
        Reason::OutcomeUnknown,
        Reason::Mismatch,
        Reason::NoKey,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Rejected => "rejected",
            Reason::Exhausted => "exhausted",
            Reason::OutcomeUnknown => "outcome_unknown",
            Reason::Mismatch => "mismatch",
            Reason::NoKey => "no_key",
        }
    }
}

/// What the broker is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fate {
    Ack,
    DeadLetter(Reason),
    /// Bring it back after `delay`; `counted`: this was an attempt (the
    /// upstream was asked and the key released), so the next delivery is
    /// the next attempt.
    Retry {
        delay: Duration,
        counted: bool,
    },
}

/// A consumer's retry settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    pub max_attempts: u32,
    pub initial: Duration,
    pub max: Duration,
}

impl RetryPolicy {
    fn backoff(&self) -> Backoff {
        Backoff::new(self.initial, self.max)
    }

    /// The wait after the `attempt`-th attempt (1-based) released its key:
    /// doubling from `initial` with jitter, at least the upstream's
    /// `Retry-After`, at most `max`.
    pub fn delay(&self, attempt: u32, retry_after: Option<Duration>, jitter: f64) -> Duration {
        let wait = self.backoff().delay(attempt.max(1), jitter);
        wait.max(retry_after.unwrap_or_default()).min(self.max)
    }
}

/// The fate of a message whose delivery is attempt number `attempt`
/// (1-based, counted per message across redeliveries and restarts) and
/// did `what`; `jitter` in `[0, 1]`.
pub fn fate(what: Happened, attempt: u32, policy: &RetryPolicy, jitter: f64) -> Fate {
    let later = |delay: Duration| Fate::Retry {
        delay: delay.clamp(policy.initial, policy.max),
        counted: false,
    };
    match what {
        Happened::Executed {
            status,
            recorded: true,
        }
        | Happened::Duplicate { status } => match status {
            0..400 => Fate::Ack,
            _ => Fate::DeadLetter(Reason::Rejected),
        },
        // The redelivery finds the key in flight (its completion is
        // retried under a renewed lease) and then its answer.
        Happened::Executed {
            recorded: false, ..
        } => later(policy.initial),
        Happened::Released { retry_after, .. } => {
            if attempt >= policy.max_attempts {
                Fate::DeadLetter(Reason::Exhausted)
            } else {
                Fate::Retry {
                    delay: policy.delay(attempt, retry_after, jitter),
                    counted: true,
                }
            }
        }
        Happened::Parked => Fate::DeadLetter(Reason::OutcomeUnknown),
        Happened::InFlight { retry_after } => later(retry_after),
        Happened::Mismatch => Fate::DeadLetter(Reason::Mismatch),
        Happened::NoKey => Fate::DeadLetter(Reason::NoKey),
        Happened::Unsettled => later(policy.initial),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 3,
            initial: S,
            max: 60 * S,
        }
    }

    /// The README's fate table, row by row.
    #[test]
    fn fate_table() {
        use Happened::*;
        let released = Released {
            status: Some(503),
            retry_after: None,
        };
        let rows: &[(Happened, u32, Fate)] = &[
            (
                Executed {
                    status: 201,
                    recorded: true,
                },
                1,
                Fate::Ack,
            ),
            (
                Executed {
                    status: 200,
                    recorded: true,
                },
                9,
                Fate::Ack,
            ),
            (
                Executed {
                    status: 302,
                    recorded: true,
                },
                1,
                Fate::Ack,
            ),
            (
                Executed {
                    status: 422,
                    recorded: true,
                },
                1,
                Fate::DeadLetter(Reason::Rejected),
            ),
            (
                Executed {
                    status: 500,
                    recorded: true,
                },
                1,
                Fate::DeadLetter(Reason::Rejected),
            ),
            (
                Executed {
                    status: 201,
                    recorded: false,
                },
                1,
                Fate::Retry {
                    delay: S,
                    counted: false,
                },
            ),
            (Duplicate { status: 201 }, 1, Fate::Ack),
            (
                Duplicate { status: 404 },
                1,
                Fate::DeadLetter(Reason::Rejected),
            ),
            // Jitter 1.0: the whole step, doubling from 1 s.
            (
                released,
                1,
                Fate::Retry {
                    delay: S,
                    counted: true,
                },
            ),
            (
                released,
                2,
                Fate::Retry {
                    delay: 2 * S,
                    counted: true,
                },
            ),
            (released, 3, Fate::DeadLetter(Reason::Exhausted)),
            (released, 7, Fate::DeadLetter(Reason::Exhausted)),
            (
                Released {
                    status: None,
                    retry_after: None,
                },
                1,
                Fate::Retry {
                    delay: S,
                    counted: true,
                },
            ),
            // Retry-After honoured, up to retry_max.
            (
                Released {
                    status: Some(429),
                    retry_after: Some(10 * S),
                },
                1,
                Fate::Retry {
                    delay: 10 * S,
                    counted: true,
                },
            ),
            (
                Released {
                    status: Some(429),
                    retry_after: Some(3600 * S),
                },
                2,
                Fate::Retry {
                    delay: 60 * S,
                    counted: true,
                },
            ),
            (Parked, 1, Fate::DeadLetter(Reason::OutcomeUnknown)),
            (
                InFlight { retry_after: 5 * S },
                1,
                Fate::Retry {
                    delay: 5 * S,
                    counted: false,
                },
            ),
            // Never a busy loop: at least retry_initial.
            (
                InFlight {
                    retry_after: Duration::ZERO,
                },
                9,
                Fate::Retry {
                    delay: S,
                    counted: false,
                },
            ),
            (Mismatch, 1, Fate::DeadLetter(Reason::Mismatch)),
            (NoKey, 1, Fate::DeadLetter(Reason::NoKey)),
            (
                Unsettled,
                5,
                Fate::Retry {
                    delay: S,
                    counted: false,
                },
            ),
        ];
        for (i, (what, attempt, want)) in rows.iter().enumerate() {
            assert_eq!(
                fate(*what, *attempt, &policy(), 1.0),
                *want,
                "row {i}: {what:?}"
            );
        }
    }

    #[test]
    fn retry_waits_double_with_jitter_and_stay_within_the_cap() {
        let p = policy();
        for attempt in 1..30 {
            let step = (S * 2u32.pow((attempt - 1).min(10))).min(p.max);
            let low = p.delay(attempt, None, 0.0);
            let high = p.delay(attempt, None, 1.0);
            assert_eq!(high, step, "attempt {attempt}");
            assert_eq!(low, step / 2, "attempt {attempt}");
        }
    }

    #[test]
    fn one_attempt_dead_letters_the_first_release() {
        let p = RetryPolicy {
            max_attempts: 1,
            ..policy()
        };
        let released = Happened::Released {
            status: Some(503),
            retry_after: None,
        };
        assert_eq!(
            fate(released, 1, &p, 0.5),
            Fate::DeadLetter(Reason::Exhausted)
        );
    }
}
