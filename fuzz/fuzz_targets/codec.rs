//! The SQL backends' stored-record codecs: the header block and
//! `RecordRow`. Decoding any bytes never panics (a corrupt record is an
//! error, never a crash), a header block that decodes is the canonical
//! encoding of what it decodes to, and any headers and completion
//! round-trip through the columns the backends write.
#![no_main]

use bytes::Bytes;
use idemgate::fuzzing::{completion_row, decode_headers, encode_headers, RecordRow};
use idemgate::idempotency::{Fingerprint, RecordState, StoredResponse};
use idemgate::store::Completion;
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|raw: &[u8]| {
    // Any bytes as a header block.
    if let Ok(headers) = decode_headers(raw) {
        assert_eq!(encode_headers(&headers), raw);
    }
    let mut u = Unstructured::new(raw);
    let _ = round_trips(&mut u);
    let _ = any_row_decodes_or_errs(&mut u);
});

fn headers(u: &mut Unstructured<'_>) -> Result<Vec<(String, Bytes)>> {
    let n = u.int_in_range(0..=8)?;
    (0..n)
        .map(|_| {
            let name: String = u.arbitrary()?;
            let value: Vec<u8> = u.arbitrary()?;
            Ok((name, Bytes::from(value)))
        })
        .collect()
}

fn round_trips(u: &mut Unstructured<'_>) -> Result<()> {
    let headers = headers(u)?;
    assert_eq!(
        decode_headers(&encode_headers(&headers)).ok(),
        Some(headers.clone())
    );
    let status: u16 = u.arbitrary()?;
    let completion = match u.int_in_range(0..=2)? {
        0 => Completion::Stored(StoredResponse {
            status,
            headers,
            body: Bytes::from(u.arbitrary::<Vec<u8>>()?),
        }),
        1 => Completion::Unstored { status },
        _ => Completion::Unknown,
    };
    let fingerprint = Fingerprint(u.arbitrary()?);
    let (created_at, expires_at) = (u.arbitrary()?, u.arbitrary()?);
    let record = completion_row(&completion, &fingerprint, created_at, expires_at)
        .into_record()
        .expect("a written row reads back");
    assert_eq!(record.fingerprint, fingerprint);
    assert_eq!(record.state, RecordState::from(&completion));
    assert_eq!(
        (record.created_at, record.expires_at),
        (created_at, expires_at)
    );
    Ok(())
}

fn any_row_decodes_or_errs(u: &mut Unstructured<'_>) -> Result<()> {
    let state = match u.int_in_range(0..=4)? {
        0 => "in_flight".to_string(),
        1 => "completed".to_string(),
        2 => "unstored".to_string(),
        3 => "unknown".to_string(),
        _ => u.arbitrary()?,
    };
    let row = RecordRow {
        fingerprint: u.arbitrary()?,
        state,
        locked_until: u.arbitrary()?,
        created_at: u.arbitrary()?,
        expires_at: u.arbitrary()?,
        status: u.arbitrary()?,
        headers: u.arbitrary()?,
        body: u.arbitrary()?,
        first_method: u.arbitrary()?,
        first_path: u.arbitrary()?,
    };
    let _ = row.into_record();
    Ok(())
}
