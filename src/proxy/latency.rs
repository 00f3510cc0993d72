//! Each route's typical upstream latency (an exponentially weighted moving
//! average of its executions), for the `Retry-After` of a 409: when the
//! answer is likely ready, rather than when the lease would run out.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The weight of the newest sample: 1/4, so a change of pace shows within a
/// few requests and one outlier moves the estimate by a quarter.
const NEWEST_WEIGHT_DIV: u64 = 4;

/// Per route label; the routes are fixed at start, so no lock is needed.
pub struct Latencies {
    /// Microseconds; 0 = no execution seen yet.
    by_route: HashMap<Arc<String>, AtomicU64>,
}

impl Latencies {
    pub fn new<'a>(labels: impl IntoIterator<Item = &'a Arc<String>>) -> Self {
        Self {
            by_route: labels
                .into_iter()
                .map(|l| (l.clone(), AtomicU64::new(0)))
                .collect(),
        }
    }

    /// Folds one execution's duration into the route's average.
    pub fn record(&self, route: &Arc<String>, took: Duration) {
        let Some(avg) = self.by_route.get(route) else {
            return;
        };
        let sample = (took.as_micros() as u64).max(1);
        let _ = avg.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
            Some(next(old, sample))
        });
    }

    /// The route's typical latency, once one execution was seen.
    pub fn typical(&self, route: &Arc<String>) -> Option<Duration> {
        let micros = self.by_route.get(route)?.load(Ordering::Relaxed);
        (micros > 0).then(|| Duration::from_micros(micros))
    }
}

fn next(old: u64, sample: u64) -> u64 {
    if old == 0 {
        return sample;
    }
    (old - old / NEWEST_WEIGHT_DIV + sample / NEWEST_WEIGHT_DIV).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_average_starts_at_the_first_sample_and_follows_the_newest() {
        let route = Arc::new("/o".to_string());
        let l = Latencies::new([&route]);
        assert_eq!(l.typical(&route), None);
        l.record(&route, Duration::from_millis(800));
        assert_eq!(l.typical(&route), Some(Duration::from_millis(800)));
        l.record(&route, Duration::from_millis(400));
        assert_eq!(l.typical(&route), Some(Duration::from_millis(700)));
        for _ in 0..40 {
            l.record(&route, Duration::from_millis(100));
        }
        let t = l.typical(&route).unwrap();
        assert!(t < Duration::from_millis(110), "{t:?}");
        // Unknown routes are ignored.
        l.record(&Arc::new("/x".into()), Duration::from_secs(1));
        assert_eq!(l.typical(&Arc::new("/x".into())), None);
    }
}
