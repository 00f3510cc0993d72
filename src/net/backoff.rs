//! Retry waits, the one formula: doubling from a first step up to a cap,
//! with "equal jitter" (each wait is between half and all of its step, so
//! replicas recovering from the same outage spread out but still back off),
//! optionally giving up after a number of attempts or past a time budget.
//!
//! [`Backoff::next`] is the pure schedule (table-tested below); [`Retries`]
//! counts one run of failures and draws the jitter from an injectable
//! source (the process's generator unless a test passes its own).

use std::time::Duration;
use tokio::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    first: Duration,
    cap: Duration,
    max_attempts: Option<u32>,
    budget: Option<Duration>,
}

impl Backoff {
    /// Waits from `first` doubling up to `cap`, never giving up.
    pub const fn new(first: Duration, cap: Duration) -> Self {
        Self {
            first,
            cap,
            max_attempts: None,
            budget: None,
        }
    }

    /// Gives up after `max` failed attempts.
    pub const fn attempts(self, max: u32) -> Self {
        Self {
            max_attempts: Some(max),
            ..self
        }
    }

    /// Gives up when the next wait would end past `budget`, counted from
    /// the first attempt.
    pub const fn within(self, budget: Duration) -> Self {
        Self {
            budget: Some(budget),
            ..self
        }
    }

    /// The wait after the `failures`-th failure in a row (1-based), for a
    /// jitter sample in `[0, 1]`, limits aside.
    pub fn delay(&self, failures: u32, jitter: f64) -> Duration {
        let doublings = failures.saturating_sub(1).min(20);
        let step = self.first.saturating_mul(1 << doublings).min(self.cap);
        let half = step / 2;
        half + half.mul_f64(jitter.clamp(0.0, 1.0))
    }

    /// The wait before the next attempt after `failures` failed attempts
    /// that took `elapsed` so far, or `None`: give up.
    pub fn next(&self, failures: u32, elapsed: Duration, jitter: f64) -> Option<Duration> {
        if self.max_attempts.is_some_and(|max| failures >= max) {
            return None;
        }
        let wait = self.delay(failures, jitter);
        if self.budget.is_some_and(|budget| elapsed + wait >= budget) {
            return None;
        }
        Some(wait)
    }

    /// One run of retries, jittered by the process's generator.
    pub fn start(self) -> Retries {
        self.start_with(rand::random)
    }

    /// One run of retries, jittered by samples in `[0, 1]` from `jitter`.
    pub fn start_with(self, jitter: fn() -> f64) -> Retries {
        Retries {
            backoff: self,
            failures: 0,
            started: Instant::now(),
            jitter,
        }
    }
}

/// One run of failures in a row under a [`Backoff`].
#[derive(Debug)]
pub struct Retries {
    backoff: Backoff,
    failures: u32,
    started: Instant,
    jitter: fn() -> f64,
}

impl Retries {
    /// Counts a failure: the wait before the next attempt, or `None` once
    /// the attempts or the budget are spent.
    pub fn retry(&mut self) -> Option<Duration> {
        self.failures = self.failures.saturating_add(1);
        let elapsed = self.started.elapsed();
        self.backoff.next(self.failures, elapsed, (self.jitter)())
    }

    /// [`Retries::retry`] for a backoff without limits, which never gives up.
    pub fn wait(&mut self) -> Duration {
        self.retry().unwrap_or(self.backoff.cap)
    }

    /// A success: the next failure starts the schedule (and budget) again.
    pub fn reset(&mut self) {
        self.failures = 0;
        self.started = Instant::now();
    }

    /// Failures counted since the start or the last [`Retries::reset`].
    pub fn failures(&self) -> u32 {
        self.failures
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn doubles_to_its_cap_with_equal_jitter() {
        let b = Backoff::new(ms(100), ms(1_000));
        for (failures, jitter, want) in [
            (1, 0.0, ms(50)),
            (1, 1.0, ms(100)),
            (2, 1.0, ms(200)),
            (3, 0.5, ms(300)),
            (4, 1.0, ms(800)),
            (5, 1.0, ms(1_000)),
            (5, 0.0, ms(500)),
            (60, 1.0, ms(1_000)),
            // Out-of-range samples are clamped.
            (1, 7.0, ms(100)),
            (1, -1.0, ms(50)),
            // Called before any failure, it is the first step.
            (0, 1.0, ms(100)),
        ] {
            assert_eq!(b.delay(failures, jitter), want, "{failures} {jitter}");
        }
    }

    #[test]
    fn gives_up_by_attempts_or_budget() {
        let quick = Backoff::new(ms(100), ms(400)).attempts(4);
        let until = Backoff::new(ms(100), ms(5_000)).within(ms(1_000));
        for (backoff, failures, elapsed, jitter, want) in [
            (quick, 1, 0, 1.0, Some(ms(100))),
            (quick, 3, 0, 1.0, Some(ms(400))),
            (quick, 4, 0, 0.0, None),
            (until, 1, 0, 1.0, Some(ms(100))),
            (until, 1, 899, 1.0, Some(ms(100))),
            (until, 1, 900, 1.0, None),
            // A 5 s step is past a 1 s budget.
            (until, 50, 0, 1.0, None),
        ] {
            let got = backoff.next(failures, ms(elapsed), jitter);
            assert_eq!(got, want, "{backoff:?} {failures} {elapsed}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn retries_count_failures_and_start_again_after_a_success() {
        let mut run = Backoff::new(ms(100), ms(400))
            .attempts(3)
            .start_with(|| 1.0);
        let got = [run.retry(), run.retry(), run.retry()];
        assert_eq!(got, [Some(ms(100)), Some(ms(200)), None]);
        run.reset();
        assert_eq!(
            (run.failures(), run.wait(), run.failures()),
            (0, ms(100), 1)
        );
        // The budget counts from the start, or the last reset.
        let mut timed = Backoff::new(ms(100), ms(100))
            .within(ms(1_000))
            .start_with(|| 0.0);
        tokio::time::advance(ms(950)).await;
        assert_eq!(timed.retry(), None);
        timed.reset();
        assert_eq!(timed.retry(), Some(ms(50)));
    }
}
