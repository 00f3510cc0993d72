//! An upgraded connection (HTTP/1.1 `Upgrade`, e.g. WebSocket) as a byte
//! tunnel between the client and the upstream: bytes are copied both ways
//! as they come, a side that closes has its close passed on, and a tunnel
//! with no byte either way for [`TUNNEL_IDLE_TIMEOUT`] is closed.

use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// WebSocket peers ping every 20 to 60 s; five minutes without a byte
/// either way is a peer that is gone, and its descriptors are freed.
pub const TUNNEL_IDLE_TIMEOUT: Duration = Duration::from_secs(300);

/// One read's worth; a tunnel holds two.
const BUFFER: usize = 16 * 1024;

/// Bytes copied by a tunnel, per direction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Copied {
    pub to_upstream: u64,
    pub to_client: u64,
}

/// Copies between the two upgraded connections until both sides closed,
/// one failed, or nothing moved for `idle`. `count(to_upstream, to_client)`
/// is told of every write as it happens (metrics), the totals returned.
pub async fn run(
    client: Upgraded,
    upstream: Upgraded,
    idle: Duration,
    count: impl Fn(u64, u64),
) -> Copied {
    pump(TokioIo::new(client), TokioIo::new(upstream), idle, count).await
}

async fn pump<S>(client: S, upstream: S, idle: Duration, count: impl Fn(u64, u64)) -> Copied
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    // Index 0 is the client's side, 1 the upstream's; `copied[from]` counts
    // the bytes read from a side and written to the other.
    let mut sides = [client, upstream];
    let mut bufs = [vec![0u8; BUFFER], vec![0u8; BUFFER]];
    let mut open = [true, true];
    let mut copied = [0u64; 2];
    while open[0] || open[1] {
        let [a, b] = &mut sides;
        let [buf_a, buf_b] = &mut bufs;
        // Reads are cancel-safe; the write below is bounded by the idle time.
        let (from, read) = tokio::select! {
            r = a.read(buf_a), if open[0] => (0, r),
            r = b.read(buf_b), if open[1] => (1, r),
            () = tokio::time::sleep(idle) => break,
        };
        let to = &mut sides[1 - from];
        match read {
            Ok(0) => {
                open[from] = false;
                let _ = to.shutdown().await;
            }
            Ok(n) => {
                // A peer that stops reading must not hold the tunnel past
                // the idle time either.
                let written = tokio::time::timeout(idle, to.write_all(&bufs[from][..n])).await;
                if !matches!(written, Ok(Ok(()))) {
                    break;
                }
                copied[from] += n as u64;
                let (up, down) = if from == 0 { (n, 0) } else { (0, n) };
                count(up as u64, down as u64);
            }
            Err(_) => break,
        }
    }
    Copied {
        to_upstream: copied[0],
        to_client: copied[1],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: a write to a peer that stops reading was unbounded (the
    /// idle timer only raced the reads), so the tunnel never closed.
    #[tokio::test(start_paused = true)]
    async fn a_peer_that_stops_reading_closes_the_tunnel_after_the_idle_time() {
        let (client, mut client_peer) = tokio::io::duplex(64);
        // The upstream's peer never reads: its pipe fills after 64 bytes.
        let (upstream, _upstream_peer) = tokio::io::duplex(64);
        let tunnel = tokio::spawn(pump(client, upstream, Duration::from_secs(5), |_, _| {}));
        // Blocks once both pipes are full; fails when the tunnel lets go.
        tokio::spawn(async move { client_peer.write_all(&[7u8; 4096]).await });
        tokio::time::timeout(Duration::from_secs(60), tunnel)
            .await
            .expect("the tunnel closes")
            .unwrap();
    }

    #[tokio::test]
    async fn bytes_go_both_ways_and_a_close_is_passed_on() {
        let (client, mut client_peer) = tokio::io::duplex(64);
        let (upstream, mut upstream_peer) = tokio::io::duplex(64);
        let tunnel = tokio::spawn(pump(client, upstream, Duration::from_secs(5), |_, _| {}));
        client_peer.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        upstream_peer.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ping");
        upstream_peer.write_all(b"pong!").await.unwrap();
        let mut buf = [0u8; 5];
        client_peer.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"pong!");
        drop(client_peer);
        // The upstream sees the client's close, then closes its side.
        let mut rest = Vec::new();
        upstream_peer.read_to_end(&mut rest).await.unwrap();
        drop(upstream_peer);
        let copied = tunnel.await.unwrap();
        assert_eq!(
            copied,
            Copied {
                to_upstream: 4,
                to_client: 5
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_tunnel_is_closed() {
        let (client, _client_peer) = tokio::io::duplex(64);
        let (upstream, _upstream_peer) = tokio::io::duplex(64);
        let copied = pump(client, upstream, Duration::from_secs(1), |_, _| {}).await;
        assert_eq!(copied, Copied::default());
    }
}
