//! A small OTLP/HTTP trace receiver: `POST /v1/traces` with a protobuf
//! `ExportTraceServiceRequest`, decoded with `opentelemetry-proto` and kept
//! (the spans, flattened, and every request body as received, so a test can
//! search the raw export for what must never be in it).

use super::serve::{server, TestServer};
use super::wait_until;
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use prost::Message;
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

/// One exported span, with ids in lower-case hex and attribute values as
/// strings.
#[derive(Clone, Debug)]
pub struct RecordedSpan {
    pub service: String,
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    pub name: String,
    /// `SpanKind` as in the protocol: 2 server, 3 client, 1 internal.
    pub kind: i32,
    pub attributes: BTreeMap<String, String>,
    /// 0 unset, 1 ok, 2 error.
    pub status_code: i32,
}

impl RecordedSpan {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

#[derive(Default)]
struct Received {
    spans: Vec<RecordedSpan>,
    bodies: Vec<Bytes>,
}

/// The receiver on 127.0.0.1:0; stops when dropped.
pub struct OtlpReceiver {
    pub addr: SocketAddr,
    received: Arc<Mutex<Received>>,
    _server: TestServer,
}

impl OtlpReceiver {
    pub async fn start() -> Self {
        let received = Arc::new(Mutex::new(Received::default()));
        let state = received.clone();
        let server = server()
            .serve(move |req, _| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(receive(&state, req).await) }
            })
            .await;
        Self {
            addr: server.addr,
            received,
            _server: server,
        }
    }

    /// The base URL to configure as `tracing.otlp_endpoint`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn spans(&self) -> Vec<RecordedSpan> {
        self.received.lock().unwrap().spans.clone()
    }

    /// Every export request body, as received.
    pub fn bodies(&self) -> Vec<Bytes> {
        self.received.lock().unwrap().bodies.clone()
    }

    /// Waits until a span satisfies `pred`, and returns it.
    pub async fn wait_for_span(
        &self,
        what: &str,
        pred: impl Fn(&RecordedSpan) -> bool,
    ) -> RecordedSpan {
        wait_until(what, || self.spans().iter().any(&pred)).await;
        self.spans().into_iter().find(pred).expect("just seen")
    }
}

async fn receive(state: &Mutex<Received>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, body: Vec<u8>| {
        let mut resp = Response::new(Full::new(Bytes::from(body)));
        *resp.status_mut() = status;
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/x-protobuf"),
        );
        resp
    };
    if req.method() != Method::POST || req.uri().path() != "/v1/traces" {
        return reply(StatusCode::NOT_FOUND, Vec::new());
    }
    let content_type = req
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let Ok(body) = req.into_body().collect().await.map(|b| b.to_bytes()) else {
        return reply(StatusCode::BAD_REQUEST, Vec::new());
    };
    assert_eq!(
        content_type, "application/x-protobuf",
        "OTLP/HTTP protobuf expected"
    );
    let export = ExportTraceServiceRequest::decode(body.clone())
        .expect("the export is a valid ExportTraceServiceRequest");
    let mut spans = Vec::new();
    for rs in export.resource_spans {
        let service = rs
            .resource
            .iter()
            .flat_map(|r| r.attributes.iter())
            .find(|kv| kv.key == "service.name")
            .map(value_string)
            .unwrap_or_default();
        for ss in rs.scope_spans {
            for s in ss.spans {
                spans.push(RecordedSpan {
                    service: service.clone(),
                    trace_id: hex::encode(&s.trace_id),
                    span_id: hex::encode(&s.span_id),
                    parent_span_id: hex::encode(&s.parent_span_id),
                    name: s.name,
                    kind: s.kind,
                    attributes: s
                        .attributes
                        .iter()
                        .map(|kv| (kv.key.clone(), value_string(kv)))
                        .collect(),
                    status_code: s.status.map(|st| st.code).unwrap_or(0),
                });
            }
        }
    }
    let mut r = state.lock().unwrap();
    r.bodies.push(body);
    r.spans.extend(spans);
    reply(
        StatusCode::OK,
        ExportTraceServiceResponse::default().encode_to_vec(),
    )
}

fn value_string(kv: &KeyValue) -> String {
    match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}
