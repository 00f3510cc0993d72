//! The global budget for buffered request bodies (`server.max_buffered_body_bytes`).
//!
//! A protected request's body is read whole before its key is claimed, so
//! without a bound every stalled client holds up to its route's
//! `max_request_body` in memory, and enough of them exhaust it. A body's
//! bytes are reserved here before any of it is read: its exact length when
//! the request declares one, else the route's limit. Past the budget the
//! request is refused (503) without being buffered. The reservation travels
//! with the bytes ([`Reservation::hold`]) and is returned when the last
//! copy of them is dropped: when the request is forwarded and sent, or
//! given up on.

use bytes::Bytes;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Bytes of request bodies that may be buffered at once, process-wide.
#[derive(Debug)]
pub struct BodyBudget {
    limit: u64,
    /// `idemgate_buffered_body_bytes`: what is reserved now (the one
    /// count, updated atomically against the limit).
    reserved: Gauge,
    /// `idemgate_body_budget_refusals_total`.
    refusals: Counter,
}

impl BodyBudget {
    pub fn new(limit: u64, reserved: Gauge, refusals: Counter) -> Arc<Self> {
        Arc::new(Self {
            limit,
            reserved,
            refusals,
        })
    }

    /// Reserves `bytes`, or `None` (counted as a refusal) when that would
    /// pass the budget.
    pub fn try_reserve(self: &Arc<Self>, bytes: u64) -> Option<Reservation> {
        let (bytes_i, limit) = (gauge_value(bytes), gauge_value(self.limit));
        let fits =
            self.reserved
                .inner()
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                    used.checked_add(bytes_i).filter(|total| *total <= limit)
                });
        if fits.is_err() {
            self.refusals.inc();
            return None;
        }
        Some(Reservation {
            budget: self.clone(),
            bytes,
        })
    }
}

fn gauge_value(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// Bytes taken from a [`BodyBudget`], given back on drop.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<BodyBudget>,
    bytes: u64,
}

impl Reservation {
    /// The body read under this reservation, which now lasts as long as
    /// any copy of the returned bytes.
    pub fn hold(self, body: Vec<u8>) -> Bytes {
        Bytes::from_owner(Held {
            body,
            _reservation: self,
        })
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.reserved.dec_by(gauge_value(self.bytes));
    }
}

/// A buffered body and the reservation it was read under.
struct Held {
    body: Vec<u8>,
    _reservation: Reservation,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.body
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_are_refused_past_the_limit_and_returned_with_the_bytes() {
        let refusals = Counter::default();
        let budget = BodyBudget::new(10, Gauge::default(), refusals.clone());
        let six = budget.try_reserve(6).expect("fits");
        assert!(budget.try_reserve(5).is_none(), "6 + 5 > 10");
        let four = budget.try_reserve(4).expect("6 + 4 fits");
        assert_eq!(refusals.get(), 1);
        let bytes = six.hold(vec![1; 6]);
        let copy = bytes.clone();
        drop(bytes);
        assert!(budget.try_reserve(1).is_none(), "a copy still holds it");
        drop(copy);
        drop(four);
        assert!(budget.try_reserve(10).is_some(), "all returned");
        assert_eq!(budget.reserved.get(), 0);
    }
}
