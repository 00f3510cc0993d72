//! The global budget for buffered request bodies (`server.max_buffered_body_bytes`).
//!
//! A protected request's body is read whole before its key is claimed, so
//! without a bound every stalled client holds up to its route's
//! `max_request_body` in memory, and enough of them exhaust it. A body's
//! bytes are reserved here before they are read: its exact length up front
//! when the request declares one, else chunk by chunk as they arrive (the
//! buffer's capacity, grown through [`Reservation::make_room`]). Reserving
//! the route's limit up front would need room the budget may never have
//! (a limit above the running budget: every such body refused, however
//! small). Past the budget the request is refused (503) without being
//! buffered any further. The reservation travels
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
        if !self.take(bytes) {
            self.refusals.inc();
            return None;
        }
        Some(Reservation {
            budget: self.clone(),
            bytes,
        })
    }

    /// Adds `bytes` to what is reserved, unless that would pass the limit.
    fn take(&self, bytes: u64) -> bool {
        let (bytes_i, limit) = (gauge_value(bytes), gauge_value(self.limit));
        self.reserved
            .inner()
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes_i).filter(|total| *total <= limit)
            })
            .is_ok()
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
    /// Makes room in `buf` for `more` bytes past its length, the
    /// reservation growing with its capacity, so what is reserved is what
    /// the buffer holds allocated: doubled (at most to `cap`) while the
    /// budget allows, so a body in many chunks is not copied per chunk,
    /// else just what is needed. `false`, with nothing changed and counted
    /// as a refusal, only when the bytes themselves would pass the budget.
    pub fn make_room(&mut self, buf: &mut Vec<u8>, more: usize, cap: u64) -> bool {
        let (len, had) = (buf.len(), buf.capacity());
        let needed = len.saturating_add(more);
        if needed <= had {
            return true;
        }
        let cap = usize::try_from(cap).unwrap_or(usize::MAX);
        let doubled = had.saturating_mul(2).min(cap).max(needed);
        for target in [doubled, needed] {
            let grow = (target - had) as u64;
            if self.budget.take(grow) {
                // Exact: a Vec's capacity is what it was asked for.
                buf.reserve_exact(target - len);
                debug_assert_eq!(buf.capacity(), target);
                self.bytes += grow;
                return true;
            }
        }
        self.budget.refusals.inc();
        false
    }

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

    /// Regression: a body without a length reserved its route's whole
    /// `max_request_body` up front, so with a limit above the budget every
    /// such body was refused, 13 bytes on an idle proxy too. It reserves
    /// as its chunks arrive: the buffer's capacity, doubled while the
    /// budget allows, else exactly what is read; refused only when the
    /// bytes read would pass the budget; all of it returned with the bytes.
    #[test]
    fn a_body_without_a_length_reserves_as_its_chunks_arrive() {
        let refusals = Counter::default();
        let budget = BodyBudget::new(100, Gauge::default(), refusals.clone());
        let route_limit = 1_000; // above the budget
        let mut r = budget.try_reserve(0).expect("nothing reserved yet");
        let mut buf = Vec::new();
        // (chunk, reserved after it = the buffer's capacity)
        for (chunk, reserved) in [(13, 13), (7, 26), (6, 26), (30, 56), (40, 96), (4, 100)] {
            assert!(r.make_room(&mut buf, chunk, route_limit), "{chunk}");
            buf.extend(std::iter::repeat_n(b'x', chunk));
            assert_eq!(budget.reserved.get(), reserved, "after {chunk}");
            assert_eq!(buf.capacity() as i64, reserved, "after {chunk}");
        }
        assert_eq!(buf.len(), 100, "every chunk kept");
        assert_eq!(refusals.get(), 0);
        // One more byte would pass the budget: refused, nothing changed.
        assert!(!r.make_room(&mut buf, 1, route_limit));
        assert_eq!((budget.reserved.get(), buf.capacity()), (100, 100));
        assert_eq!(refusals.get(), 1);
        // Another body fits in what is left once this one is returned.
        let bytes = r.hold(buf);
        assert!(budget.try_reserve(1).is_none(), "held with the bytes");
        drop(bytes);
        assert_eq!(budget.reserved.get(), 0, "all returned");

        // Doubling stops at the route's limit, and at what the budget has.
        let mut r = budget.try_reserve(0).unwrap();
        let mut buf = Vec::new();
        assert!(r.make_room(&mut buf, 40, 50));
        buf.extend([0; 40]);
        assert!(r.make_room(&mut buf, 5, 50));
        assert_eq!(buf.capacity(), 50, "doubled, capped by the limit");
        buf.extend([0; 5]);
        let other = budget.try_reserve(50).unwrap();
        assert!(!r.make_room(&mut buf, 6, 1_000), "50 + 50 + 1 > 100");
        assert!(r.make_room(&mut buf, 5, 1_000), "no growth needed");
        drop(other);
        let other = budget.try_reserve(40).unwrap();
        assert!(
            r.make_room(&mut buf, 6, 1_000),
            "doubling does not fit, 1 more does"
        );
        assert_eq!((buf.capacity(), budget.reserved.get()), (51, 91));
        drop((r, other));
        assert_eq!(budget.reserved.get(), 0);
    }
}
