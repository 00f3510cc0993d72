//! Bytes and rows as the backends keep them: the stored-header encoding
//! (SQL columns and Redis values), and [`RecordRow`], the one mapping from a
//! SQL row's columns to a [`Record`]. No I/O here.

use super::{FirstUse, Record, RecordState, StoreError, StoredResponse};
use crate::idempotency::{Fingerprint, RecordKey, Scope};
use bytes::Bytes;

/// Encodes headers as `count:u32, (name_len:u16, name, value_len:u32, value)*`.
pub fn encode_headers(headers: &[(String, Bytes)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + headers.len() * 32);
    out.extend_from_slice(&(headers.len() as u32).to_be_bytes());
    for (name, value) in headers {
        out.extend_from_slice(&(name.len() as u16).to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&(value.len() as u32).to_be_bytes());
        out.extend_from_slice(value);
    }
    out
}

/// Inverse of [`encode_headers`].
pub fn decode_headers(mut buf: &[u8]) -> Result<Vec<(String, Bytes)>, StoreError> {
    fn take<'a>(buf: &mut &'a [u8], n: usize) -> Result<&'a [u8], StoreError> {
        if buf.len() < n {
            return Err(StoreError::Corrupt("truncated header block".into()));
        }
        let (head, rest) = buf.split_at(n);
        *buf = rest;
        Ok(head)
    }
    let count = u32::from_be_bytes(array_from(take(&mut buf, 4)?, "header count")?);
    let mut headers = Vec::with_capacity(count.min(1024) as usize);
    for _ in 0..count {
        let name_len = u16::from_be_bytes(array_from(take(&mut buf, 2)?, "name length")?);
        let name = std::str::from_utf8(take(&mut buf, usize::from(name_len))?)
            .map_err(|_| StoreError::Corrupt("header name is not UTF-8".into()))?
            .to_string();
        let value_len = u32::from_be_bytes(array_from(take(&mut buf, 4)?, "value length")?);
        let value = Bytes::copy_from_slice(take(&mut buf, value_len as usize)?);
        headers.push((name, value));
    }
    if !buf.is_empty() {
        return Err(StoreError::Corrupt("trailing bytes after headers".into()));
    }
    Ok(headers)
}

/// Fixed-size byte columns read back from a backend.
pub fn array_from<const N: usize>(bytes: &[u8], what: &str) -> Result<[u8; N], StoreError> {
    bytes
        .try_into()
        .map_err(|_| StoreError::Corrupt(format!("{what} has {} bytes, expected {N}", bytes.len())))
}

/// A record's columns as the SQL backends keep them; [`RecordRow::into_record`]
/// is the one place they become a [`Record`].
pub struct RecordRow {
    pub fingerprint: Vec<u8>,
    pub state: String,
    pub locked_until: i64,
    pub created_at: i64,
    pub expires_at: i64,
    pub status: Option<i64>,
    pub headers: Option<Vec<u8>>,
    pub body: Option<Vec<u8>>,
    /// NULL on a record claimed before migration 4.
    pub first_method: Option<String>,
    pub first_path: Option<String>,
}

impl RecordRow {
    pub fn into_record(self) -> Result<Record, StoreError> {
        let status = || -> Result<u16, StoreError> {
            self.status
                .and_then(|s| u16::try_from(s).ok())
                .ok_or_else(|| StoreError::Corrupt("record has no valid status".into()))
        };
        let state = match self.state.as_str() {
            "in_flight" => RecordState::InFlight {
                locked_until: self.locked_until,
            },
            "completed" => RecordState::Completed(StoredResponse {
                status: status()?,
                headers: decode_headers(self.headers.as_deref().unwrap_or_default())?,
                body: Bytes::from(self.body.unwrap_or_default()),
            }),
            "unstored" => RecordState::Unstored { status: status()? },
            "unknown" => RecordState::Unknown,
            other => return Err(StoreError::Corrupt(format!("unknown state {other:?}"))),
        };
        Ok(Record {
            fingerprint: Fingerprint(array_from(&self.fingerprint, "fingerprint")?),
            state,
            created_at: self.created_at,
            expires_at: self.expires_at,
            first_use: self
                .first_method
                .zip(self.first_path)
                .map(|(method, path)| FirstUse { method, path }),
        })
    }
}

/// A primary key as a scan reads it back: its scope and key columns.
pub fn record_key_from(scope: &[u8], key: &[u8]) -> Result<RecordKey, StoreError> {
    Ok(RecordKey {
        scope: Scope(array_from(scope, "scope")?),
        key: array_from(key, "key")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_encoding_round_trips_repeated_and_binary_values() {
        let headers = vec![
            ("location".to_string(), Bytes::from_static(b"/orders/1")),
            ("x-multi".to_string(), Bytes::from_static(b"a, b")),
            ("x-multi".to_string(), Bytes::from_static(b"c")),
            ("x-bin".to_string(), Bytes::from_static(b"\xff\x00")),
        ];
        let encoded = encode_headers(&headers);
        assert_eq!(decode_headers(&encoded).unwrap(), headers);
        assert!(decode_headers(&encoded[..encoded.len() - 1]).is_err());
        assert_eq!(decode_headers(&encode_headers(&[])).unwrap(), vec![]);
    }
}
