//! Per-consumer metrics (`[[consumer]]`), labelled by the consumer's name
//! (bounded: the names the config lists) and, for dead letters, by reason.

use super::add;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::Arc;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConsumerLabels {
    consumer: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeadLetterLabels {
    consumer: Arc<str>,
    reason: &'static str,
}

pub struct ConsumerMetrics {
    received: Family<ConsumerLabels, Counter>,
    executed: Family<ConsumerLabels, Counter>,
    duplicates: Family<ConsumerLabels, Counter>,
    dead_lettered: Family<DeadLetterLabels, Counter>,
    retried: Family<ConsumerLabels, Counter>,
    not_told: Family<ConsumerLabels, Counter>,
    in_flight: Family<ConsumerLabels, Gauge>,
    broker_up: Family<ConsumerLabels, Gauge>,
}

impl ConsumerMetrics {
    pub(super) fn register(registry: &mut Registry) -> Self {
        Self {
            received: add(registry, "consumer_messages_received", "Message deliveries taken from the broker, by consumer (redeliveries included)"),
            executed: add(registry, "consumer_messages_executed", "Messages the upstream executed (answer stored), by consumer"),
            duplicates: add(registry, "consumer_duplicates_suppressed", "Deliveries answered from a recorded answer without calling the upstream (duplicates, redeliveries), by consumer"),
            dead_lettered: add(registry, "consumer_messages_dead_lettered", "Messages dead-lettered, by consumer and reason: rejected (a stored 4xx), exhausted (max_attempts), outcome_unknown, mismatch (key reused with another payload), no_key"),
            retried: add(registry, "consumer_messages_retried", "Deliveries returned to the broker to come back later (released, in flight elsewhere, or unsettled), by consumer"),
            not_told: add(registry, "consumer_fates_not_told", "Fates (ack, dead-letter, retry) the broker was not told: the connection or channel was gone (lapin did not send an ack or reject), the operation failed or had no answer in time; the broker redelivers the message and its record answers. By consumer"),
            in_flight: add(registry, "consumer_in_flight", "Deliveries being handled now, by consumer"),
            broker_up: add(registry, "consumer_broker_up", "1 while the consumer's broker connection is up and consuming, 0 while it reconnects"),
        }
    }

    fn labels(consumer: &Arc<str>) -> ConsumerLabels {
        ConsumerLabels {
            consumer: consumer.clone(),
        }
    }

    /// Creates every series of `consumer` at zero, so a scrape sees them
    /// before the first message.
    pub fn register_consumer(&self, consumer: &Arc<str>, reasons: &[&'static str]) {
        let l = Self::labels(consumer);
        drop(self.received.get_or_create(&l));
        drop(self.executed.get_or_create(&l));
        drop(self.duplicates.get_or_create(&l));
        drop(self.retried.get_or_create(&l));
        drop(self.not_told.get_or_create(&l));
        drop(self.in_flight.get_or_create(&l));
        self.broker_up.get_or_create(&l).set(0);
        for &reason in reasons {
            self.dead_letter_counter(consumer, reason);
        }
    }

    fn dead_letter_counter(&self, consumer: &Arc<str>, reason: &'static str) -> Counter {
        self.dead_lettered
            .get_or_create(&DeadLetterLabels {
                consumer: consumer.clone(),
                reason,
            })
            .clone()
    }

    pub fn received(&self, consumer: &Arc<str>) {
        self.received.get_or_create(&Self::labels(consumer)).inc();
    }

    pub fn executed(&self, consumer: &Arc<str>) {
        self.executed.get_or_create(&Self::labels(consumer)).inc();
    }

    pub fn duplicate(&self, consumer: &Arc<str>) {
        self.duplicates.get_or_create(&Self::labels(consumer)).inc();
    }

    pub fn dead_lettered(&self, consumer: &Arc<str>, reason: &'static str) {
        self.dead_letter_counter(consumer, reason).inc();
    }

    pub fn retried(&self, consumer: &Arc<str>) {
        self.retried.get_or_create(&Self::labels(consumer)).inc();
    }

    pub fn not_told(&self, consumer: &Arc<str>) {
        self.not_told.get_or_create(&Self::labels(consumer)).inc();
    }

    pub fn in_flight(&self, consumer: &Arc<str>) -> Gauge {
        self.in_flight
            .get_or_create(&Self::labels(consumer))
            .clone()
    }

    pub fn broker_up(&self, consumer: &Arc<str>, up: bool) {
        self.broker_up
            .get_or_create(&Self::labels(consumer))
            .set(i64::from(up));
    }
}
