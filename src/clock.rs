//! The wall clock, passed in rather than read from free functions, so tests
//! can pause and advance it together with tokio's timers.
//!
//! Stored times (`locked_until`, `expires_at`) are unix milliseconds. In
//! production they come from the system clock; a test can make them follow
//! tokio's clock instead ([`Clock::following_tokio`]), so
//! `tokio::time::pause()` + `advance()` move leases and ttls in step with
//! sleeps, or shift them ([`Clock::offset_by`]) to play a replica whose clock
//! is wrong; [`Clock::scope`] hands such a clock to an in-process server.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// Milliseconds since the Unix epoch, as the store keeps them.
pub type UnixMillis = i64;

/// A source of unix milliseconds. Cheap to copy. The default is the
/// system's wall clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct Clock {
    source: Source,
    /// Added to every reading (tests only; zero in production).
    offset_ms: i64,
}

#[derive(Clone, Copy, Debug, Default)]
enum Source {
    /// The system clock, never read backwards (see [`never_backwards`]).
    #[default]
    System,
    /// Wall time at `start`, then advancing with tokio's (pausable) clock.
    Tokio {
        wall_at_start: UnixMillis,
        start: Instant,
    },
}

/// Test-only: milliseconds added to this process's clock, so fault tests
/// can run a replica whose clock is wrong. Never set it in production.
pub const TEST_OFFSET_ENV: &str = "IDEMGATE_TEST_CLOCK_OFFSET_MS";

impl Clock {
    pub fn system() -> Self {
        Self::default()
    }

    /// The system clock, shifted by [`TEST_OFFSET_ENV`] when that is set
    /// (inside [`Clock::scope`]: that scope's clock).
    pub fn from_env() -> Self {
        if let Ok(clock) = SCOPED.try_with(|c| *c) {
            return clock;
        }
        let offset = std::env::var(TEST_OFFSET_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<i64>().ok())
            .unwrap_or(0);
        if offset != 0 {
            tracing::warn!(
                offset_ms = offset,
                "{TEST_OFFSET_ENV} is set: this process's clock is shifted (tests only)"
            );
        }
        Self::system().offset_by(offset)
    }

    /// Starts at the system's wall time and then advances with
    /// `tokio::time::Instant`, so a paused tokio clock pauses it too.
    pub fn following_tokio() -> Self {
        Self {
            source: Source::Tokio {
                wall_at_start: system_millis(),
                start: Instant::now(),
            },
            offset_ms: 0,
        }
    }

    /// Test-only: runs `fut` (a server starting in process) with
    /// [`Clock::from_env`] answering this clock.
    pub async fn scope<F: std::future::Future>(self, fut: F) -> F::Output {
        SCOPED.scope(self, fut).await
    }

    /// The same clock, `offset_ms` ahead (negative: behind).
    pub fn offset_by(self, offset_ms: i64) -> Self {
        Self {
            offset_ms: self.offset_ms + offset_ms,
            ..self
        }
    }

    pub fn now_millis(&self) -> UnixMillis {
        let base = match self.source {
            Source::System => never_backwards(&LATEST, system_millis()),
            Source::Tokio {
                wall_at_start,
                start,
            } => wall_at_start + millis(start.elapsed()),
        };
        base + self.offset_ms
    }
}

tokio::task_local! {
    static SCOPED: Clock;
}

/// A duration in the store's unit, saturating (config caps durations far
/// below `i64::MAX` milliseconds).
pub fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The latest system clock reading this process has handed out.
static LATEST: AtomicI64 = AtomicI64::new(0);

/// `reading`, or the latest one handed out if the clock stepped back (an NTP
/// step, a VM restore): on SQLite and the memory store this process's clock
/// judges leases, and a clock going back would stretch a dead holder's
/// lease or bring an expired record back. A forward step is followed (the
/// lease of a request in flight may then look shorter until it renews);
/// PostgreSQL judges time by its own clock.
fn never_backwards(latest: &AtomicI64, reading: UnixMillis) -> UnixMillis {
    let previous = latest.fetch_max(reading, Ordering::Relaxed);
    previous.max(reading)
}

fn system_millis() -> UnixMillis {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(millis)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_tokio_clock_moves_only_when_tokio_time_does() {
        let clock = Clock::following_tokio();
        let t0 = clock.now_millis();
        assert_eq!(clock.now_millis(), t0);
        tokio::time::advance(Duration::from_millis(1_500)).await;
        assert_eq!(clock.now_millis(), t0 + 1_500);
    }

    #[test]
    fn a_clock_stepping_back_is_held_at_its_latest_reading() {
        let latest = AtomicI64::new(0);
        assert_eq!(never_backwards(&latest, 1_000), 1_000);
        assert_eq!(never_backwards(&latest, 1_500), 1_500);
        // An NTP step back by a second.
        assert_eq!(never_backwards(&latest, 500), 1_500);
        assert_eq!(never_backwards(&latest, 1_400), 1_500);
        assert_eq!(never_backwards(&latest, 1_600), 1_600);
    }

    #[test]
    fn an_offset_shifts_every_reading() {
        let skewed = Clock::system().offset_by(3_000);
        let plain = Clock::system().now_millis();
        let ahead = skewed.now_millis();
        assert!((ahead - plain - 3_000).abs() < 1_000, "{ahead} vs {plain}");
        assert!(system_millis() > 1_700_000_000_000);
    }
}
