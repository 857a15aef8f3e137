//! The operator: a contender that runs `leasectl outbox retry <id>` on live events near the
//! head of the outbox while the relays drain it, as a person repairing the outbox by hand at the
//! wrong moment would. Each retry rewrites its event's row (a new row version: attempts,
//! `next_attempt_at`, `dead_at`) between a claim's look at the window and its `DELETE`, or
//! waits for the batch that holds the row; neither may lose, reorder or duplicate an event, so
//! the round's invariants hold unchanged with it.
//!
//! Its retries are bounded: a retry waiting for the row lock of a stopped or frozen relay's batch
//! is killed after [`RETRY_DEADLINE`] (the round's faults decide how long such a batch lives).

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use tokio_postgres::types::Type;

/// How long one `outbox retry` may take before it is killed.
const RETRY_DEADLINE: Duration = Duration::from_secs(5);

/// What the operator did in a round.
#[derive(Debug, Default, Clone, Copy)]
pub struct OperatorStats {
    /// Retries that re-queued their event (exit 0).
    pub requeued: u64,
    /// Retries that ended otherwise: the event was gone by then (published), or the database
    /// was unavailable.
    pub other: u64,
    /// Retries killed at [`RETRY_DEADLINE`].
    pub killed: u64,
}

/// Where and how the operator works.
pub struct OperatorSpec {
    pub bin: std::path::PathBuf,
    /// A direct connection to the test database (never through the fault proxy: the operator
    /// is a person at a terminal, not one of the relays under test).
    pub conninfo: String,
    pub schema: String,
    pub seed: u64,
}

/// Retries one of the first ten live events every 100–300 ms until `stop`.
pub fn operator(spec: &OperatorSpec, stop: &AtomicBool) -> OperatorStats {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(spec.seed);
    let mut stats = OperatorStats::default();
    let mut client: Option<tokio_postgres::Client> = None;
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(rng.random_range(100..=300)));
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            let conninfo = format!("{} connect_timeout=3", spec.conninfo);
            client = rt
                .block_on(tokio_postgres::connect(&conninfo, tokio_postgres::NoTls))
                .ok()
                .map(|(c, conn)| {
                    rt.spawn(conn);
                    c
                });
        }
        let Some(c) = client.as_ref() else { continue };
        let offset = rng.random_range(0..10i64);
        let pick = format!(
            "SELECT id::text FROM \"{}\".outbox WHERE dead_at IS NULL ORDER BY seq OFFSET $1 LIMIT 1",
            spec.schema
        );
        let params: [(&(dyn tokio_postgres::types::ToSql + Sync), Type); 1] =
            [(&offset, Type::INT8)];
        let look = c.query_typed_opt(&pick, &params);
        let id: Option<String> =
            match rt.block_on(async { tokio::time::timeout(RETRY_DEADLINE, look).await }) {
                Ok(Ok(row)) => row.map(|r| r.get(0)),
                // An error or no answer (a fault of the round): a new connection next time.
                _ => {
                    client = None;
                    None
                }
            };
        let Some(id) = id else { continue };
        match retry(spec, &id) {
            Some(true) => stats.requeued += 1,
            Some(false) => stats.other += 1,
            None => stats.killed += 1,
        }
    }
    stats
}

/// Runs `leasectl outbox retry ID`: Some(whether it exited 0), None when it was killed at the
/// deadline.
fn retry(spec: &OperatorSpec, id: &str) -> Option<bool> {
    let mut child = Command::new(&spec.bin)
        .args([
            "--database-url",
            &format!("{} connect_timeout=3", spec.conninfo),
            "--schema",
            &spec.schema,
            "outbox",
            "retry",
            id,
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let deadline = Instant::now() + RETRY_DEADLINE;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status.success());
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
