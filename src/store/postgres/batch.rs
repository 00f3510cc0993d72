//! Group commit: claims and completions that arrive together go out as
//! one multi-row statement ([`crate::store::batch`] coalesces them); a
//! lone one, or each of a failed batch's, as its own statement.

use super::pool::{Core, Param};
use super::PostgresStore;
use crate::idempotency::{RecordKey, Scope};
use crate::store::batch::{Batcher, Completing, Sharing};
use crate::store::codec::{array_from, RecordRow};
use crate::store::sql::{KeyParams, OwnerParams, RECORD_COLUMNS};
use crate::store::{is_claimable, Claim, ClaimOutcome, Fence, Record, RecordState, StoreError};
use deadpool_postgres::ClientWrapper;
use tokio_postgres::types::Type;

/// A claim that loses a race with a release or sweep between its two
/// statements retries; more than this many losses in a row is pathological.
const CLAIM_ATTEMPTS: usize = 5;

/// How many batches of each kind run at once: enough to keep a few
/// connections busy, few enough that calls queue up and coalesce.
const BATCH_LANES: usize = 4;
/// Rows per statement, at most.
const BATCH_MAX: usize = 64;

impl PostgresStore {
    pub(super) fn claims(&self) -> &Batcher<Claim, Result<ClaimOutcome, StoreError>> {
        self.claims.get_or_init(|| {
            let core = self.core.clone();
            let key = |claim: &Claim| claim.key;
            // A duplicate storm on one key: one read answers the claims
            // queued behind it (`crate::store::batch`, "Sharing").
            let sharing = Sharing {
                same: |leader: &Claim, follower: &Claim| leader.fingerprint == follower.fingerprint,
                copy: Claim::clone,
                answer: shared_claim,
            };
            Batcher::start_sharing(BATCH_LANES, BATCH_MAX, key, Some(sharing), move |claims| {
                let core = core.clone();
                async move { core.claim_many(claims).await }
            })
        })
    }

    pub(super) fn completions(&self) -> &Batcher<Completing, Result<Fence, StoreError>> {
        self.completions.get_or_init(|| {
            let core = self.core.clone();
            let key = |completing: &Completing| completing.key;
            Batcher::start(BATCH_LANES, BATCH_MAX, key, move |completions| {
                let core = core.clone();
                async move { core.complete_many(completions).await }
            })
        })
    }
}

pub(super) fn batcher_gone() -> StoreError {
    StoreError::unavailable("postgres: the batching task has stopped")
}

/// `record` with its times moved by `by` milliseconds (from the server's
/// frame into the caller's; see [`super::Span`]).
fn shifted(mut record: Record, by: i64) -> Record {
    if let RecordState::InFlight { locked_until } = &mut record.state {
        *locked_until += by;
    }
    record.created_at += by;
    record.expires_at += by;
    record
}

/// The answer `follower` (same key and fingerprint, queued before
/// `leader`'s statement was sent) takes from `leader`'s: the record it
/// found, on the follower's clock, unless the follower may claim it by
/// then; never a claim granted (the follower must find that claim in
/// flight, which only its own statement can say), nor an error.
fn shared_claim(
    leader: &Claim,
    follower: &Claim,
    answer: &Result<ClaimOutcome, StoreError>,
) -> Option<Result<ClaimOutcome, StoreError>> {
    let Ok(ClaimOutcome::Existing(record)) = answer else {
        return None;
    };
    let record = shifted(record.clone(), follower.now - leader.now);
    if is_claimable(&record, &follower.fingerprint, follower.now) {
        return None;
    }
    Some(Ok(ClaimOutcome::Existing(record)))
}

/// The record columns starting at column `at`.
pub(super) fn decode_row(row: &tokio_postgres::Row, at: usize) -> Result<Record, StoreError> {
    let corrupt = |err: tokio_postgres::Error| StoreError::Corrupt(format!("postgres row: {err}"));
    RecordRow {
        fingerprint: row.try_get(at).map_err(corrupt)?,
        state: row.try_get(at + 1).map_err(corrupt)?,
        locked_until: row.try_get(at + 2).map_err(corrupt)?,
        created_at: row.try_get(at + 3).map_err(corrupt)?,
        expires_at: row.try_get(at + 4).map_err(corrupt)?,
        status: row
            .try_get::<_, Option<i32>>(at + 5)
            .map_err(corrupt)?
            .map(i64::from),
        headers: row.try_get(at + 6).map_err(corrupt)?,
        body: row.try_get(at + 7).map_err(corrupt)?,
        first_method: row.try_get(at + 8).map_err(corrupt)?,
        first_path: row.try_get(at + 9).map_err(corrupt)?,
    }
    .into_record()
}

/// What a claim-or-read row says from column `at` on (`takeover`, the
/// server's "now", then the record found): `None` when the claim wrote
/// nothing and the record it found is claimable by now.
fn settled(
    row: &tokio_postgres::Row,
    at: usize,
    claim: &Claim,
) -> Option<Result<ClaimOutcome, StoreError>> {
    if let Some(takeover) = row.get::<_, Option<bool>>(at) {
        return Some(Ok(ClaimOutcome::Claimed { takeover }));
    }
    row.get::<_, Option<Vec<u8>>>(at + 2)?;
    existing(row, at + 2, row.get(at + 1), claim)
}

/// The record at column `at`, read at the server's `server_now`, as the
/// live record `claim` finds; `None` when the claim may take it.
fn existing(
    row: &tokio_postgres::Row,
    at: usize,
    server_now: i64,
    claim: &Claim,
) -> Option<Result<ClaimOutcome, StoreError>> {
    match decode_row(row, at).map(|r| shifted(r, claim.now - server_now)) {
        Ok(record) if is_claimable(&record, &claim.fingerprint, claim.now) => None,
        Ok(record) => Some(Ok(ClaimOutcome::Existing(record))),
        Err(err) => Some(Err(err)),
    }
}

impl Core {
    /// Claims many keys (distinct) in one statement; each answer is what
    /// [`Store::claim`] would give. A statement that fails without timing
    /// out changed nothing, so its keys are claimed one by one (one bad row
    /// cannot fail its neighbours); one that timed out may still commit,
    /// so every key gets the timeout (and is given back by its caller).
    pub(super) async fn claim_many(
        &self,
        claims: Vec<Claim>,
    ) -> Vec<Result<ClaimOutcome, StoreError>> {
        if let [claim] = claims.as_slice() {
            return vec![self.claim_one(claim).await];
        }
        let answers = match self.claim_batch(&claims).await {
            Ok(answers) => answers,
            Err(StoreError::Timeout) => {
                return claims.iter().map(|_| Err(StoreError::Timeout)).collect()
            }
            Err(err) => {
                tracing::debug!(error = %err, rows = claims.len(), "batched claim failed; claiming one by one");
                claims.iter().map(|_| None).collect()
            }
        };
        let mut out = Vec::with_capacity(claims.len());
        for (claim, answer) in claims.iter().zip(answers) {
            out.push(match answer {
                Some(answer) => answer,
                // Changed under the batch's snapshot: settle it alone.
                None => self.claim_one(claim).await,
            });
        }
        out
    }

    /// The claim's statements on `client`: one round trip in the common
    /// cases, more when it races with a release or sweep.
    pub(super) async fn claim_on(
        &self,
        client: &ClientWrapper,
        claim: &Claim,
    ) -> Result<Result<ClaimOutcome, StoreError>, tokio_postgres::Error> {
        let key = KeyParams::new(&claim.key);
        let fingerprint = &claim.fingerprint.0[..];
        let token = &claim.token.0[..];
        let method = claim.first_use.as_ref().map(|f| f.method.as_str());
        let path = claim.first_use.as_ref().map(|f| f.path.as_str());
        let params: [Param<'_>; 9] = [
            (&key.scope, Type::BYTEA),
            (&key.key, Type::BYTEA),
            (&fingerprint, Type::BYTEA),
            (&token, Type::BYTEA),
            (&claim.lease_ms, Type::INT8),
            (&self.clock_offset_ms, Type::INT8),
            (&claim.ttl_ms, Type::INT8),
            (&method, Type::TEXT),
            (&path, Type::TEXT),
        ];
        // One round trip in the common cases: it claims, or it finds a
        // live record and writes nothing (a replay takes no row lock).
        let rows = self.query(client, &self.sql.claim_or_read, &params).await?;
        let Some(row) = rows.first() else {
            return Ok(Err(StoreError::Corrupt("the claim answered no row".into())));
        };
        if let Some(outcome) = settled(row, 0, claim) {
            return Ok(outcome);
        }
        // A concurrent claim, release or sweep changed the record between
        // this statement's snapshot and its insert: settle it the long way.
        for _ in 0..CLAIM_ATTEMPTS {
            let rows = self.query(client, &self.sql.claim, &params).await?;
            if let Some(row) = rows.first() {
                return Ok(Ok(ClaimOutcome::Claimed {
                    takeover: row.get(0),
                }));
            }
            // A live record is there. This SELECT is a new snapshot, so it
            // sees the row the claim conflicted with, unless that was
            // released or swept in between: then claim again. It may also
            // have changed in between: a record that is claimable by now
            // is claimed again rather than reported as live.
            let rows = self
                .query(
                    client,
                    &self.sql.select_at,
                    &[
                        (&key.scope, Type::BYTEA),
                        (&key.key, Type::BYTEA),
                        (&self.clock_offset_ms, Type::INT8),
                    ],
                )
                .await?;
            if let Some(outcome) = rows
                .first()
                .and_then(|row| existing(row, 0, row.get(RECORD_COLUMNS), claim))
            {
                return Ok(outcome);
            }
        }
        Ok(Err(StoreError::unavailable(format!(
            "claim raced with concurrent deletes {CLAIM_ATTEMPTS} times"
        ))))
    }

    /// One multi-row claim; `None` for a key the statement could not settle.
    pub(super) async fn claim_batch(
        &self,
        claims: &[Claim],
    ) -> Result<Vec<Option<Result<ClaimOutcome, StoreError>>>, StoreError> {
        let scopes: Vec<&[u8]> = claims.iter().map(|c| &c.key.scope.0[..]).collect();
        let keys: Vec<&[u8]> = claims.iter().map(|c| &c.key.key[..]).collect();
        let fingerprints: Vec<&[u8]> = claims.iter().map(|c| &c.fingerprint.0[..]).collect();
        let tokens: Vec<&[u8]> = claims.iter().map(|c| &c.token.0[..]).collect();
        let leases: Vec<i64> = claims.iter().map(|c| c.lease_ms).collect();
        let ttls: Vec<i64> = claims.iter().map(|c| c.ttl_ms).collect();
        let methods: Vec<Option<&str>> = claims
            .iter()
            .map(|c| c.first_use.as_ref().map(|f| f.method.as_str()))
            .collect();
        let paths: Vec<Option<&str>> = claims
            .iter()
            .map(|c| c.first_use.as_ref().map(|f| f.path.as_str()))
            .collect();
        let rows = self
            .read(
                &self.sql.claim_many,
                &[
                    (&scopes, Type::BYTEA_ARRAY),
                    (&keys, Type::BYTEA_ARRAY),
                    (&fingerprints, Type::BYTEA_ARRAY),
                    (&tokens, Type::BYTEA_ARRAY),
                    (&leases, Type::INT8_ARRAY),
                    (&ttls, Type::INT8_ARRAY),
                    (&self.clock_offset_ms, Type::INT8),
                    (&methods, Type::TEXT_ARRAY),
                    (&paths, Type::TEXT_ARRAY),
                ],
            )
            .await?;
        if rows.len() != claims.len() {
            return Err(StoreError::Corrupt(format!(
                "a batched claim of {} keys answered {} rows",
                claims.len(),
                rows.len()
            )));
        }
        Ok(rows
            .iter()
            .zip(claims)
            .map(|(row, claim)| settled(row, 1, claim))
            .collect())
    }

    /// Completes many holders (distinct keys) in one statement, fenced per
    /// row; failures as for [`Core::claim_many`].
    pub(super) async fn complete_many(
        &self,
        items: Vec<Completing>,
    ) -> Vec<Result<Fence, StoreError>> {
        if let [one] = items.as_slice() {
            return vec![self.complete_one(one).await];
        }
        match self.complete_batch(&items).await {
            Ok(held) => items
                .iter()
                .map(|c| {
                    Ok(if held.contains(&c.key) {
                        Fence::Held
                    } else {
                        Fence::Lost
                    })
                })
                .collect(),
            Err(StoreError::Timeout) => items.iter().map(|_| Err(StoreError::Timeout)).collect(),
            Err(err) => {
                tracing::debug!(error = %err, rows = items.len(), "batched completion failed; completing one by one");
                let mut out = Vec::with_capacity(items.len());
                for c in &items {
                    out.push(self.complete_one(c).await);
                }
                out
            }
        }
    }

    /// The keys whose fence held.
    pub(super) async fn complete_batch(
        &self,
        items: &[Completing],
    ) -> Result<std::collections::HashSet<RecordKey>, StoreError> {
        let columns: Vec<_> = items.iter().map(|c| c.completion.columns()).collect();
        let scopes: Vec<&[u8]> = items.iter().map(|c| &c.key.scope.0[..]).collect();
        let keys: Vec<&[u8]> = items.iter().map(|c| &c.key.key[..]).collect();
        let tokens: Vec<&[u8]> = items.iter().map(|c| &c.token.0[..]).collect();
        let states: Vec<&str> = columns.iter().map(|c| c.state).collect();
        let statuses: Vec<Option<i32>> = columns.iter().map(|c| c.status.map(i32::from)).collect();
        let headers: Vec<Option<&[u8]>> = columns.iter().map(|c| c.headers.as_deref()).collect();
        let bodies: Vec<Option<&[u8]>> = columns.iter().map(|c| c.body).collect();
        let keeps: Vec<i64> = items.iter().map(|c| c.keep.ms).collect();
        let rows = self
            .read(
                &self.sql.complete_many,
                &[
                    (&scopes, Type::BYTEA_ARRAY),
                    (&keys, Type::BYTEA_ARRAY),
                    (&tokens, Type::BYTEA_ARRAY),
                    (&states, Type::TEXT_ARRAY),
                    (&statuses, Type::INT4_ARRAY),
                    (&headers, Type::BYTEA_ARRAY),
                    (&bodies, Type::BYTEA_ARRAY),
                    (&keeps, Type::INT8_ARRAY),
                    (&self.clock_offset_ms, Type::INT8),
                ],
            )
            .await?;
        rows.iter()
            .map(|row| {
                let scope: &[u8] = row.get(0);
                let key: &[u8] = row.get(1);
                Ok(RecordKey {
                    scope: Scope(array_from(scope, "scope")?),
                    key: array_from(key, "key")?,
                })
            })
            .collect()
    }

    pub(super) async fn claim_one(&self, claim: &Claim) -> Result<ClaimOutcome, StoreError> {
        let deadline = self.deadline();
        let client = self.checkout(deadline).await?;
        let res = tokio::time::timeout_at(
            deadline,
            self.unit(&client, false, || self.claim_on(&client, claim)),
        )
        .await;
        self.settle(client, res)?
    }

    /// One completion as its own call, fenced by its token.
    pub(super) async fn complete_one(&self, c: &Completing) -> Result<Fence, StoreError> {
        let owner = OwnerParams::new(&c.key, &c.token);
        let columns = c.completion.columns();
        let status = columns.status.map(i32::from);
        self.write(
            &self.sql.complete,
            &[
                (&owner.scope, Type::BYTEA),
                (&owner.key, Type::BYTEA),
                (&owner.token, Type::BYTEA),
                (&columns.state, Type::TEXT),
                (&status, Type::INT4),
                (&columns.headers, Type::BYTEA),
                (&columns.body, Type::BYTEA),
                (&self.clock_offset_ms, Type::INT8),
                (&c.keep.ms, Type::INT8),
            ],
        )
        .await
        .map(Fence::from_rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sample_claim;

    fn in_flight(claim: &Claim, locked_until: i64, expires_at: i64) -> Record {
        Record {
            fingerprint: claim.fingerprint,
            state: RecordState::InFlight { locked_until },
            created_at: claim.now,
            expires_at,
            first_use: None,
        }
    }

    /// What a claim queued behind another for the same key takes from its
    /// answer: the record found, on its own clock; never a claim granted,
    /// an error, or a record it may claim by its own clock.
    #[test]
    fn a_follower_takes_a_found_record_on_its_own_clock_and_nothing_else() {
        let leader = sample_claim();
        let follower = Claim {
            now: leader.now + 3,
            token: crate::store::LeaseToken([9; 16]),
            ..leader.clone()
        };
        let found = in_flight(&leader, leader.now + 1_000, leader.now + 60_000);
        let shared = shared_claim(&leader, &follower, &Ok(ClaimOutcome::Existing(found)));
        let Some(Ok(ClaimOutcome::Existing(record))) = shared else {
            panic!("an in-flight record is shared: {shared:?}");
        };
        assert_eq!(
            record.state,
            RecordState::InFlight {
                locked_until: leader.now + 1_003
            },
            "shifted to the follower's clock"
        );
        assert_eq!(record.expires_at, leader.now + 60_003);

        let claimed = Ok(ClaimOutcome::Claimed { takeover: false });
        assert!(
            shared_claim(&leader, &follower, &claimed).is_none(),
            "a claim granted is the leader's alone"
        );
        let failed = Err(StoreError::Timeout);
        assert!(shared_claim(&leader, &follower, &failed).is_none());

        // Expired by the follower's clock (0 ms left on the leader's): the
        // follower may claim it, so it asks the store itself.
        let expiring = in_flight(&leader, leader.now - 1, leader.now);
        let answer = Ok(ClaimOutcome::Existing(expiring));
        assert!(shared_claim(&leader, &follower, &answer).is_none());
    }
}
