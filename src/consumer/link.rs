//! A consumer's broker connection state, shared by the runner and a
//! source whose client reconnects by itself (JetStream).

use crate::metrics::Metrics;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tracing::{debug, info, warn};

/// The broker connection's state: the metric, `/healthz`, and the log
/// line written once per outage. Shared with a source whose client
/// reconnects by itself (JetStream), which reports through it too.
pub struct Link {
    pub name: Arc<str>,
    pub source: String,
    pub metrics: Arc<Metrics>,
    pub up: Arc<AtomicBool>,
    /// Set from the first failure of an outage to the reconnect.
    pub outage: std::sync::Mutex<bool>,
}

impl Link {
    pub fn down(&self, e: &dyn std::fmt::Display) {
        self.metrics.consumers().broker_up(&self.name, false);
        self.up.store(false, Ordering::Relaxed);
        let mut outage = self.outage.lock().unwrap_or_else(|p| p.into_inner());
        if *outage {
            debug!(consumer = %self.name, error = %e, "still reconnecting");
        } else {
            *outage = true;
            warn!(consumer = %self.name, source = %self.source, error = %e,
                "broker connection lost or refused; reconnecting with backoff (logged once per outage)");
        }
    }

    pub fn up(&self) {
        self.metrics.consumers().broker_up(&self.name, true);
        self.up.store(true, Ordering::Relaxed);
        let mut outage = self.outage.lock().unwrap_or_else(|p| p.into_inner());
        if std::mem::take(&mut *outage) {
            info!(consumer = %self.name, "broker connection back; consuming again");
        }
    }
}
