//! Message consumers (`[[consumer]]`): messages from RabbitMQ (AMQP 0-9-1)
//! and NATS JetStream, each delivered to the unmodified HTTP handler as
//! one protected request, through the same claim, forward and record as
//! an HTTP client's (`Proxy::deliver`), scoped by the consumer's name; the
//! broker is told only once the answer is durably recorded.
//!
//! - `source.rs`: the seam: a [`source::Source`] yields deliveries, each
//!   told its fate once; one module per broker (`amqp.rs`, `jetstream.rs`;
//!   a Kafka source would be one more module and one arm in `run.rs`).
//! - `deliver.rs`: a message as its request (key, headers, fingerprint),
//!   and the protected path's result read back.
//! - `fate.rs`: the fate table, pure and table-tested.
//! - `tls.rs`: TLS to the brokers through `net::tls`, and a failed
//!   handshake named by its cause.
//! - `run.rs`: connecting, reconnecting, bounded concurrency, shutdown;
//!   `link.rs`: the connection's state (metric, `/healthz`, the log line
//!   written once per outage).

mod amqp;
pub mod deliver;
pub mod fate;
mod jetstream;
mod link;
mod run;
pub mod source;
mod tls;

use crate::config::ConsumerConfig;
use crate::metrics::Metrics;
use crate::proxy::Proxy;
use arc_swap::ArcSwap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The running consumers.
pub struct Consumers {
    running: Vec<(Arc<str>, Arc<AtomicBool>, JoinHandle<()>)>,
    refusals: Option<mpsc::UnboundedReceiver<String>>,
}

impl Consumers {
    /// Starts every consumer: each connects (and reconnects) by itself,
    /// so a broker that is down delays nothing else. `stopping` begins
    /// their shutdown; all of it (finishing what they hold, closing) ends
    /// by `grace` after it.
    /// Each one's TLS files are read first: a bad one fails the start
    /// (nothing is started then).
    pub fn start(
        configs: &[ConsumerConfig],
        current: Arc<ArcSwap<Proxy>>,
        metrics: Arc<Metrics>,
        stopping: CancellationToken,
        grace: Duration,
    ) -> Result<Self, String> {
        let reasons: Vec<&'static str> = fate::Reason::ALL.iter().map(|r| r.as_str()).collect();
        let tls = configs
            .iter()
            .map(tls::client_config)
            .collect::<Result<Vec<_>, String>>()?;
        let (refused, refusals) = mpsc::unbounded_channel();
        let running = configs
            .iter()
            .zip(tls)
            .map(|(c, tls)| {
                metrics.consumers().register_consumer(&c.name, &reasons);
                let up = Arc::new(AtomicBool::new(false));
                let ctx = Arc::new(run::Context {
                    consumer: Arc::new(c.clone()),
                    current: current.clone(),
                    metrics: metrics.clone(),
                    stopping: stopping.clone(),
                    up: up.clone(),
                    tls,
                    refusals: refused.clone(),
                });
                (c.name.clone(), up, tokio::spawn(run::run(ctx, grace)))
            })
            .collect();
        Ok(Self {
            running,
            refusals: Some(refusals),
        })
    }

    /// Resolves with the first refusal of a consumer that never consumed
    /// yet (its settings cannot work with the broker's stream or durable,
    /// named): `idemgate serve` fails with it. Pending forever when taken
    /// twice.
    pub fn refused(&mut self) -> impl std::future::Future<Output = String> + Send + 'static {
        let refusals = self.refusals.take();
        async move {
            match refusals {
                Some(mut r) => match r.recv().await {
                    Some(refusal) => refusal,
                    None => std::future::pending().await,
                },
                None => std::future::pending().await,
            }
        }
    }

    /// Each consumer's broker state, shared, for `/healthz`.
    pub fn health(&self) -> ConsumerHealth {
        ConsumerHealth(
            self.running
                .iter()
                .map(|(name, up, _)| (name.clone(), up.clone()))
                .collect(),
        )
    }

    /// Waits for every consumer to stop (after `stopping`).
    pub async fn stopped(self) {
        for (_, _, task) in self.running {
            let _ = task.await;
        }
    }
}

/// The consumers' broker states, as `/healthz` shows them.
#[derive(Clone, Default)]
pub struct ConsumerHealth(Vec<(Arc<str>, Arc<AtomicBool>)>);

impl ConsumerHealth {
    /// One line per consumer: `consumer NAME: broker up|down`.
    pub fn lines(&self) -> String {
        self.0
            .iter()
            .map(|(name, up)| {
                let state = if up.load(Ordering::Relaxed) {
                    "up"
                } else {
                    "down"
                };
                format!("consumer {name}: broker {state}\n")
            })
            .collect()
    }
}
