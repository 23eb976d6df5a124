//! The member side of cluster membership, shared by shard nodes and model workers: a stable
//! node id kept in the data directory, and the heartbeat loop that registers the process with
//! the coordinators (any of them: the seed list) and tells it where the other members are now.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ragcluster_proto::v1::membership_client::MembershipClient;
use ragcluster_proto::v1::{HeartbeatRequest, HeartbeatResponse};

use crate::tls::Tls;

/// Reads the node id kept at `path`, or picks a random non-zero one and keeps it there
/// (written to a temporary file, synced, then renamed, so a crash leaves one id or none).
pub fn node_id_file(path: &Path) -> std::io::Result<u64> {
    if let Ok(s) = std::fs::read_to_string(path) {
        return s
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|id| *id != 0)
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{}: not a node id: {s:?}", path.display()),
                )
            });
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let id = loop {
        let id = rand_u64();
        if id != 0 {
            break id;
        }
    };
    let tmp = path.with_extension("tmp");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp)?;
        writeln!(f, "{id}")?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    Ok(id)
}

/// 64 random bits from the OS-seeded hasher keys (no extra dependency for one number).
fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// Bytes the files under `dir` take (what a member reports as its disk use).
pub fn dir_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(_) => e.metadata().map_or(0, |m| m.len()),
            Err(_) => 0,
        })
        .sum()
}

/// How a member heartbeats.
#[derive(Clone)]
pub struct Heartbeat {
    /// Coordinator addresses to try, in turn.
    pub coordinators: Vec<String>,
    /// Between two heartbeats (the coordinator's answer may ask for another interval).
    pub interval: Duration,
    pub tls: Option<Arc<Tls>>,
}

/// What the member says about itself on each beat.
pub type Report = Arc<dyn Fn() -> HeartbeatRequest + Send + Sync>;
/// What it does with each answer (e.g. learn the other members' addresses).
pub type OnAnswer = Arc<dyn Fn(&HeartbeatResponse) + Send + Sync>;

/// The member-side metric families.
pub fn families() -> Vec<crate::families::Family> {
    crate::families::table(&[(
        "member_heartbeat_failures_total",
        crate::families::Kind::Counter,
        "heartbeats to the coordinators that got no answer",
    )])
}

/// Heartbeats until the returned task is aborted. A failed beat moves to the next coordinator
/// at once; the first failure of a streak and the recovery are logged.
pub fn spawn(hb: Heartbeat, report: Report, on_answer: OnAnswer) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if hb.coordinators.is_empty() {
            return;
        }
        let mut i = 0usize;
        let mut failing = false;
        let mut interval = hb.interval;
        let mut client: Option<MembershipClient<tonic::transport::Channel>> = None;
        loop {
            let addr = &hb.coordinators[i % hb.coordinators.len()];
            match beat(&mut client, addr, hb.tls.as_ref(), report()).await {
                Ok(r) => {
                    if failing {
                        tracing::info!(coordinator = %addr, "heartbeats answered again");
                    }
                    failing = false;
                    if r.interval_ms > 0 {
                        interval = Duration::from_millis(u64::from(r.interval_ms));
                    }
                    on_answer(&r);
                    tokio::time::sleep(interval).await;
                }
                Err(e) => {
                    client = None;
                    metrics::counter!("member_heartbeat_failures_total").increment(1);
                    if failing {
                        tracing::debug!(coordinator = %addr, error = %e, "heartbeat failed");
                    } else {
                        tracing::warn!(coordinator = %addr, error = %e, "heartbeat failed");
                    }
                    failing = true;
                    i += 1;
                    // A full round without an answer: wait before the next.
                    let pause = if i.is_multiple_of(hb.coordinators.len()) {
                        interval
                    } else {
                        Duration::from_millis(100)
                    };
                    tokio::time::sleep(pause).await;
                }
            }
        }
    })
}

async fn beat(
    client: &mut Option<MembershipClient<tonic::transport::Channel>>,
    addr: &str,
    tls: Option<&Arc<Tls>>,
    req: HeartbeatRequest,
) -> Result<HeartbeatResponse, String> {
    const TIMEOUT: Duration = Duration::from_secs(5);
    if client.is_none() {
        let ch = crate::tls::channel(addr, tls, |ep| {
            ep.connect_timeout(Duration::from_millis(500))
                .timeout(TIMEOUT)
        })
        .await
        .map_err(|e| e.to_string())?;
        *client = Some(MembershipClient::new(ch));
    }
    let Some(c) = client.as_mut() else {
        return Err("no connection".into());
    };
    let mut r = tonic::Request::new(req);
    r.set_timeout(TIMEOUT);
    c.heartbeat(r)
        .await
        .map(tonic::Response::into_inner)
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_id_is_kept() {
        let dir = std::env::temp_dir().join(format!("ragcluster-nodeid-{}", rand_u64()));
        let p = dir.join("node_id");
        let a = node_id_file(&p).unwrap();
        assert_ne!(a, 0);
        assert_eq!(node_id_file(&p).unwrap(), a);
        std::fs::write(&p, "zero").unwrap();
        assert!(node_id_file(&p).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
