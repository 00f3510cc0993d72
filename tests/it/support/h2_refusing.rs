//! HTTP/2 upstreams (h2c, prior knowledge) that refuse streams, written
//! frame by frame (RFC 9113 §4) so they can send what a server library
//! does not let a test choose:
//!
//! - [`RefusingH2Upstream`]: per request stream, in order, refuses it
//!   (`RST_STREAM` `REFUSED_STREAM`), sends a `GOAWAY` whose last-stream-id
//!   is below it and closes, or answers 201 (an execution);
//! - [`RefusingH2Relay`]: in front of a real h2c server, refuses a share of
//!   the streams and relays the rest, frame by frame. It advertises a zero
//!   HPACK table to the client, so dropping a refused stream's header
//!   block leaves the server's decoder in step.

use super::seed::Seed;
use crate::hostile_connections::h2raw::frame;
use rand::rngs::StdRng;
use rand::Rng;
use std::collections::{HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

const PREFACE_LEN: usize = 24;
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const REFUSED_STREAM: u32 = 0x7;
const NO_ERROR: u32 = 0x0;
const SETTINGS_HEADER_TABLE_SIZE: u16 = 0x1;

struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

fn encode(f: &Frame) -> Vec<u8> {
    frame(f.kind, f.flags, f.stream, &f.payload)
}

async fn read_frame(r: &mut (impl AsyncRead + Unpin)) -> Option<Frame> {
    let mut head = [0u8; 9];
    r.read_exact(&mut head).await.ok()?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload).await.ok()?;
    let stream = u32::from_be_bytes(head[5..9].try_into().expect("4 bytes")) & 0x7fff_ffff;
    Some(Frame {
        kind: head[3],
        flags: head[4],
        stream,
        payload,
    })
}

fn rst_stream(stream: u32, code: u32) -> Vec<u8> {
    frame(RST_STREAM, 0, stream, &code.to_be_bytes())
}

fn goaway(last: u32, code: u32) -> Vec<u8> {
    let mut payload = last.to_be_bytes().to_vec();
    payload.extend(code.to_be_bytes());
    frame(GOAWAY, 0, 0, &payload)
}

fn window_update(stream: u32, n: u32) -> Vec<u8> {
    frame(WINDOW_UPDATE, 0, stream, &n.to_be_bytes())
}

/// What [`RefusingH2Upstream`] does with one request stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// `RST_STREAM` with `REFUSED_STREAM`.
    Refuse,
    /// `GOAWAY` (`NO_ERROR`) with the last-stream-id below this stream,
    /// then the connection closes.
    GoAwayBelow,
    /// 201 with a small body: the request executed.
    Answer,
}

#[derive(Default)]
struct Counts {
    answered: AtomicUsize,
    refused: AtomicUsize,
    goaways: AtomicUsize,
}

/// The scripted upstream on 127.0.0.1:0: each request stream, across
/// connections, takes the next [`Act`]; past the script, it answers.
pub struct RefusingH2Upstream {
    pub addr: SocketAddr,
    counts: Arc<Counts>,
    task: JoinHandle<()>,
}

impl RefusingH2Upstream {
    pub async fn start(script: &[Act]) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let script = Arc::new(Mutex::new(script.iter().copied().collect::<VecDeque<_>>()));
        let counts = Arc::new(Counts::default());
        let c = counts.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve_scripted(stream, script.clone(), c.clone()));
            }
        });
        Self { addr, counts, task }
    }

    /// Requests answered (executed).
    pub fn answered(&self) -> usize {
        self.counts.answered.load(Ordering::SeqCst)
    }

    /// Streams refused with `REFUSED_STREAM`.
    pub fn refused(&self) -> usize {
        self.counts.refused.load(Ordering::SeqCst)
    }

    /// `GOAWAY`s sent below a stream.
    pub fn goaways(&self) -> usize {
        self.counts.goaways.load(Ordering::SeqCst)
    }
}

impl Drop for RefusingH2Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The HPACK block of a 201 (`:status` as a literal without indexing,
/// RFC 7541 §6.2.2: no table state).
const STATUS_201: [u8; 5] = [0x08, 0x03, b'2', b'0', b'1'];

async fn serve_scripted(mut s: TcpStream, script: Arc<Mutex<VecDeque<Act>>>, counts: Arc<Counts>) {
    let mut preface = [0u8; PREFACE_LEN];
    if s.read_exact(&mut preface).await.is_err() {
        return;
    }
    if s.write_all(&frame(SETTINGS, 0, 0, &[])).await.is_err() {
        return;
    }
    // Streams to answer once their request has ended.
    let mut answering: HashSet<u32> = HashSet::new();
    while let Some(f) = read_frame(&mut s).await {
        let mut out = Vec::new();
        match f.kind {
            SETTINGS if f.flags & ACK == 0 => out.extend(frame(SETTINGS, ACK, 0, &[])),
            PING if f.flags & ACK == 0 => out.extend(frame(PING, ACK, 0, &f.payload)),
            HEADERS => {
                let act = script.lock().unwrap().pop_front().unwrap_or(Act::Answer);
                match act {
                    Act::Refuse => {
                        counts.refused.fetch_add(1, Ordering::SeqCst);
                        out.extend(rst_stream(f.stream, REFUSED_STREAM));
                    }
                    Act::GoAwayBelow => {
                        counts.goaways.fetch_add(1, Ordering::SeqCst);
                        let _ = s
                            .write_all(&goaway(f.stream.saturating_sub(2), NO_ERROR))
                            .await;
                        // A moment for the client to read it, then close.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        return;
                    }
                    Act::Answer => {
                        answering.insert(f.stream);
                    }
                }
            }
            DATA if f.flags & END_STREAM == 0 && !f.payload.is_empty() => {
                // Give the window back so larger bodies keep coming.
                let n = f.payload.len() as u32;
                out.extend(window_update(0, n));
                out.extend(window_update(f.stream, n));
            }
            _ => {}
        }
        let ended = matches!(f.kind, HEADERS | DATA) && f.flags & END_STREAM != 0;
        if ended && answering.remove(&f.stream) {
            counts.answered.fetch_add(1, Ordering::SeqCst);
            out.extend(frame(HEADERS, END_HEADERS, f.stream, &STATUS_201));
            out.extend(frame(DATA, END_STREAM, f.stream, b"{\"ok\":true}"));
        }
        if !out.is_empty() && s.write_all(&out).await.is_err() {
            return;
        }
    }
}

/// The relay on 127.0.0.1:0 in front of `backend`: refuses
/// `refuse_percent` of the request streams (never a connection's first,
/// whose header block may fill the HPACK table before the client has read
/// the relay's settings) and relays the rest. The n-th connection's
/// refusals are drawn from `seed` and n.
pub struct RefusingH2Relay {
    pub addr: SocketAddr,
    refused: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl RefusingH2Relay {
    pub async fn start(backend: SocketAddr, refuse_percent: u32, seed: Seed) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let refused = Arc::new(AtomicUsize::new(0));
        let r = refused.clone();
        let task = tokio::spawn(async move {
            for n in 0.. {
                let Ok((client, _)) = listener.accept().await else {
                    break;
                };
                let Ok(server) = TcpStream::connect(backend).await else {
                    continue;
                };
                let rng = seed.rng(format_args!("relay connection {n}"));
                tokio::spawn(relay(client, server, refuse_percent, rng, r.clone()));
            }
        });
        Self {
            addr,
            refused,
            task,
        }
    }

    /// Streams refused so far.
    pub fn refused(&self) -> usize {
        self.refused.load(Ordering::SeqCst)
    }
}

impl Drop for RefusingH2Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(
    client: TcpStream,
    server: TcpStream,
    refuse_percent: u32,
    mut rng: StdRng,
    refused: Arc<AtomicUsize>,
) {
    let (mut client_r, client_w) = client.into_split();
    let (mut server_r, mut server_w) = server.into_split();
    let client_w = Arc::new(tokio::sync::Mutex::new(client_w));
    let to_client = client_w.clone();
    // Server to client: frame by frame (the relay writes to the client
    // too), its SETTINGS with a zero HPACK table added.
    let down = tokio::spawn(async move {
        while let Some(mut f) = read_frame(&mut server_r).await {
            if f.kind == SETTINGS && f.flags & ACK == 0 {
                f.payload.extend(SETTINGS_HEADER_TABLE_SIZE.to_be_bytes());
                f.payload.extend(0u32.to_be_bytes());
            }
            if to_client.lock().await.write_all(&encode(&f)).await.is_err() {
                return;
            }
        }
    });
    let mut preface = [0u8; PREFACE_LEN];
    if client_r.read_exact(&mut preface).await.is_ok() && server_w.write_all(&preface).await.is_ok()
    {
        let mut dropped: HashSet<u32> = HashSet::new();
        let mut first = true;
        while let Some(f) = read_frame(&mut client_r).await {
            let opens = f.kind == HEADERS && !dropped.contains(&f.stream);
            if opens && !std::mem::take(&mut first) && rng.random_range(0..100) < refuse_percent {
                dropped.insert(f.stream);
                refused.fetch_add(1, Ordering::SeqCst);
                let _ = client_w
                    .lock()
                    .await
                    .write_all(&rst_stream(f.stream, REFUSED_STREAM))
                    .await;
                continue;
            }
            // Nothing of a refused stream reaches the server (an
            // RST_STREAM for a stream it never saw would be an error).
            if dropped.contains(&f.stream) {
                // The client spent connection window on it: give it back.
                if f.kind == DATA && !f.payload.is_empty() {
                    let n = f.payload.len() as u32;
                    let _ = client_w.lock().await.write_all(&window_update(0, n)).await;
                }
                continue;
            }
            if server_w.write_all(&encode(&f)).await.is_err() {
                break;
            }
        }
    }
    down.abort();
}
