//! A WebSocket echo upstream over raw TCP (RFC 6455: the handshake with
//! its SHA-1/base64 accept key, and frames), and the frame helpers a test
//! client uses to talk through the proxy. Every text frame is answered
//! with `echo: <text>`; a close frame is answered with a close frame and
//! the connection is closed.

use base64::Engine;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// RFC 6455 §1.3.
const GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC11B65";
pub const TEXT: u8 = 0x1;
pub const CLOSE: u8 = 0x8;

/// `Sec-WebSocket-Accept` for a `Sec-WebSocket-Key`.
pub fn accept_key(key: &str) -> String {
    let digest = sha1_smol::Sha1::from(format!("{key}{GUID}"))
        .digest()
        .bytes();
    base64::engine::general_purpose::STANDARD.encode(digest)
}

/// One frame, FIN set; masked (as a client must) when `mask` is given.
pub fn encode(opcode: u8, payload: &[u8], mask: Option<[u8; 4]>) -> Vec<u8> {
    let mut out = vec![0x80 | opcode];
    let bit = if mask.is_some() { 0x80 } else { 0 };
    match payload.len() {
        n if n < 126 => out.push(bit | n as u8),
        n if n <= u16::MAX as usize => {
            out.push(bit | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(bit | 127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    match mask {
        Some(m) => {
            out.extend_from_slice(&m);
            out.extend(payload.iter().enumerate().map(|(i, b)| b ^ m[i % 4]));
        }
        None => out.extend_from_slice(payload),
    }
    out
}

/// Reads one frame: (opcode, unmasked payload).
pub async fn read_frame(s: &mut (impl AsyncRead + Unpin)) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 2];
    s.read_exact(&mut head).await?;
    let opcode = head[0] & 0x0f;
    let masked = head[1] & 0x80 != 0;
    let len = match head[1] & 0x7f {
        126 => {
            let mut b = [0u8; 2];
            s.read_exact(&mut b).await?;
            u16::from_be_bytes(b) as usize
        }
        127 => {
            let mut b = [0u8; 8];
            s.read_exact(&mut b).await?;
            u64::from_be_bytes(b) as usize
        }
        n => n as usize,
    };
    let mask = if masked {
        let mut m = [0u8; 4];
        s.read_exact(&mut m).await?;
        Some(m)
    } else {
        None
    };
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload).await?;
    if let Some(m) = mask {
        for (i, b) in payload.iter_mut().enumerate() {
            *b ^= m[i % 4];
        }
    }
    Ok((opcode, payload))
}

/// Reads an HTTP/1.1 head (through the blank line), byte by byte so
/// nothing after it is consumed.
pub async fn read_head(s: &mut (impl AsyncRead + Unpin)) -> std::io::Result<String> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if s.read(&mut byte).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        head.push(byte[0]);
        assert!(head.len() < 64 * 1024, "head too long");
    }
    Ok(String::from_utf8_lossy(&head).into_owned())
}

/// A header's value in a head read by [`read_head`] (name case-insensitive).
pub fn header<'h>(head: &'h str, name: &str) -> Option<&'h str> {
    head.lines().skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// The echo upstream on 127.0.0.1:0.
pub struct WsUpstream {
    pub addr: SocketAddr,
    heads: Arc<Mutex<Vec<String>>>,
    task: JoinHandle<()>,
}

impl Drop for WsUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl WsUpstream {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind ws upstream");
        let addr = listener.local_addr().expect("addr");
        let heads = Arc::new(Mutex::new(Vec::new()));
        let seen = heads.clone();
        // Raw bytes on the socket (no hyper), through the one accept loop.
        let task = tokio::spawn(async move {
            let open = tokio_util::task::TaskTracker::new();
            let (never, limit) = (std::future::pending(), tokio::sync::Semaphore::MAX_PERMITS);
            idemgate::net::listen::serve("ws", listener, limit, &open, never, |stream, _| {
                let seen = seen.clone();
                async move {
                    let _ = serve(stream, seen).await;
                }
            })
            .await;
        });
        Self { addr, heads, task }
    }

    /// The request heads received, in order.
    pub fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }
}

async fn serve(mut s: TcpStream, seen: Arc<Mutex<Vec<String>>>) -> std::io::Result<()> {
    let head = read_head(&mut s).await?;
    seen.lock().unwrap().push(head.clone());
    let Some(key) = header(&head, "sec-websocket-key") else {
        // Not an upgrade (the proxy stripped it): say so plainly.
        let body = "not a websocket handshake";
        s.write_all(
            format!(
                "HTTP/1.1 400 Bad Request\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await?;
        return Ok(());
    };
    let accept = accept_key(key);
    s.write_all(
        format!(
            "HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-accept: {accept}\r\n\r\n"
        )
        .as_bytes(),
    )
    .await?;
    echo(&mut s).await
}

async fn echo(s: &mut (impl AsyncRead + AsyncWrite + Unpin)) -> std::io::Result<()> {
    loop {
        let (opcode, payload) = read_frame(s).await?;
        if opcode == CLOSE {
            s.write_all(&encode(CLOSE, &payload, None)).await?;
            s.shutdown().await?;
            return Ok(());
        }
        let mut reply = b"echo: ".to_vec();
        reply.extend_from_slice(&payload);
        s.write_all(&encode(opcode, &reply, None)).await?;
    }
}
