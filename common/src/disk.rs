//! Free space under a process's data directory, watched so that a full disk is met before a
//! write fails half-way: below `min_free` bytes the directory counts as full, the process
//! refuses new writes (RESOURCE_EXHAUSTED naming the cause) and releases a reserve file kept
//! at start, which leaves room for what must still be written (Raft hard state, flushes, index
//! commits of writes already acknowledged). Once space is back above the threshold with room
//! for the reserve, the reserve is taken again and writes resume, without a restart.
//! TiKV keeps a placeholder file and refuses proposals on a full store the same way.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::watch;

/// Name of the reserve file in the watched directory.
pub const RESERVE_FILE: &str = ".disk-reserve";

/// How a data directory is watched (`*.disk_min_free_bytes` and friends in the config).
#[derive(Debug, Clone, Copy)]
pub struct DiskPolicy {
    /// Below this many free bytes the directory is full.
    pub min_free: u64,
    /// Bytes held in the reserve file while space is plentiful, released when full.
    pub reserve: u64,
    /// Between two looks at the free space.
    pub interval: Duration,
}

/// Bytes free for unprivileged writers and the size of the file system holding `dir`.
pub fn free_space(dir: &Path) -> std::io::Result<(u64, u64)> {
    let st = rustix::fs::statvfs(dir)?;
    Ok((
        st.f_bavail.saturating_mul(st.f_frsize),
        st.f_blocks.saturating_mul(st.f_frsize),
    ))
}

/// Whether an error message is the operating system's "no space left" (RocksDB and tantivy
/// pass ENOSPC on as text only).
pub fn is_no_space(message: &str) -> bool {
    message.contains("No space left on device") || message.contains("os error 28")
}

/// The watcher of one directory: `check` before a write, `note_error` after a failed one.
pub struct DiskGuard {
    dir: PathBuf,
    policy: DiskPolicy,
    /// Why the directory counts as full (None: it does not).
    state: watch::Sender<Option<String>>,
    /// Serialises the reserve file's removal and re-creation.
    reserve: Mutex<()>,
}

impl DiskGuard {
    /// Takes the reserve (when there is room for it) and starts the watching thread.
    pub fn start(dir: &Path, policy: DiskPolicy) -> std::io::Result<Arc<Self>> {
        std::fs::create_dir_all(dir)?;
        let g = Arc::new(Self {
            dir: dir.to_owned(),
            policy,
            state: watch::Sender::new(None),
            reserve: Mutex::new(()),
        });
        g.look();
        let weak = Arc::downgrade(&g);
        std::thread::Builder::new()
            .name("disk-guard".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(policy.interval);
                    let Some(g) = weak.upgrade() else { return };
                    g.look();
                }
            })?;
        Ok(g)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Why the directory counts as full, if it does.
    pub fn full(&self) -> Option<String> {
        self.state.borrow().clone()
    }

    /// `Err(why)` while the directory is full.
    pub fn check(&self) -> Result<(), String> {
        match self.full() {
            Some(why) => Err(why),
            None => Ok(()),
        }
    }

    /// Changes of the full state, for tasks that act on it (leadership hand-off).
    pub fn watch(&self) -> watch::Receiver<Option<String>> {
        self.state.subscribe()
    }

    /// A write failed: when for want of space, the directory is full from now on (without
    /// waiting for the next look).
    pub fn note_error(&self, message: &str) {
        if is_no_space(message) && self.full().is_none() {
            let free = free_space(&self.dir).map_or(0, |f| f.0);
            self.enter(format!(
                "a write in {} failed for want of space ({free} bytes free)",
                self.dir.display()
            ));
        }
    }

    /// One look at the free space: enters or leaves the full state.
    fn look(&self) {
        let (free, _) = match free_space(&self.dir) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), error = %e, "free space unknown");
                return;
            }
        };
        metrics::gauge!("disk_free_bytes").set(free as f64);
        let p = self.policy;
        match self.full() {
            None if free < p.min_free => self.enter(format!(
                "{} has {free} bytes free, below the {} kept free",
                self.dir.display(),
                p.min_free
            )),
            None => {
                let _ = self.take_reserve();
            }
            // Leaves once the reserve fits again with the threshold still kept.
            Some(_) if free >= p.min_free.saturating_add(p.reserve) => match self.take_reserve() {
                Ok(()) => {
                    tracing::info!(dir = %self.dir.display(), free,
                        "disk space back: writes accepted again");
                    metrics::gauge!("disk_full").set(0.0);
                    self.state.send_replace(None);
                }
                Err(e) => tracing::warn!(dir = %self.dir.display(), error = %e,
                    "disk space back but the reserve cannot be taken; still refusing writes"),
            },
            Some(_) => {}
        }
    }

    fn enter(&self, why: String) {
        let released = self.release_reserve();
        tracing::warn!(dir = %self.dir.display(), reason = %why, released,
            "disk full: writes refused until space is freed; reserve released");
        metrics::counter!("disk_full_events_total").increment(1);
        metrics::gauge!("disk_full").set(1.0);
        self.state.send_replace(Some(why));
    }

    fn reserve_path(&self) -> PathBuf {
        self.dir.join(RESERVE_FILE)
    }

    /// Bytes given back by removing the reserve file.
    fn release_reserve(&self) -> u64 {
        let _g = self.reserve.lock();
        let p = self.reserve_path();
        let len = std::fs::metadata(&p).map_or(0, |m| m.len());
        match std::fs::remove_file(&p) {
            Ok(()) => len,
            Err(_) => 0,
        }
    }

    /// Makes sure the reserve file holds `policy.reserve` allocated bytes.
    fn take_reserve(&self) -> std::io::Result<()> {
        let _g = self.reserve.lock();
        let want = self.policy.reserve;
        let p = self.reserve_path();
        if want == 0 || std::fs::metadata(&p).is_ok_and(|m| m.len() >= want) {
            return Ok(());
        }
        let f = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(false)
            .open(&p)?;
        let r = allocate(&f, want).and_then(|()| f.sync_all());
        if r.is_err() {
            drop(f);
            let _ = std::fs::remove_file(&p);
        }
        r
    }
}

/// Allocates `len` bytes for `f` (blocks really taken, not a sparse file).
fn allocate(f: &std::fs::File, len: u64) -> std::io::Result<()> {
    rustix::fs::fallocate(f, rustix::fs::FallocateFlags::empty(), 0, len)?;
    Ok(())
}

/// The disk-guard metric families (every process with a data directory).
pub fn families() -> Vec<crate::families::Family> {
    use crate::families::Kind;
    crate::families::table(&[
        (
            "disk_free_bytes",
            Kind::Gauge,
            "bytes free on the file system of the data directory",
        ),
        (
            "disk_full",
            Kind::Gauge,
            "1 while the data directory is below its free-space threshold (writes refused)",
        ),
        (
            "disk_full_events_total",
            Kind::Counter,
            "times the data directory became full",
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("ragcluster-disk-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_threshold_above_the_free_space_is_full_and_says_why() {
        let d = dir().join("full");
        let g = DiskGuard::start(
            &d,
            DiskPolicy {
                min_free: u64::MAX,
                reserve: 1 << 20,
                interval: Duration::from_secs(3600),
            },
        )
        .unwrap();
        let why = g.check().unwrap_err();
        assert!(why.contains("bytes free, below the"), "{why}");
        assert!(!d.join(RESERVE_FILE).exists(), "the reserve is released");
    }

    #[test]
    fn room_takes_the_reserve_and_an_enospc_error_makes_it_full() {
        let d = dir().join("room");
        let g = DiskGuard::start(
            &d,
            DiskPolicy {
                min_free: 1,
                reserve: 1 << 20,
                interval: Duration::from_secs(3600),
            },
        )
        .unwrap();
        assert!(g.check().is_ok());
        assert_eq!(
            std::fs::metadata(d.join(RESERVE_FILE)).unwrap().len(),
            1 << 20
        );
        g.note_error("IO error: some other failure");
        assert!(g.check().is_ok());
        g.note_error("IO error: No space left on device: While appending to file");
        assert!(g.check().unwrap_err().contains("for want of space"));
        assert!(!d.join(RESERVE_FILE).exists());
        // The next look finds room again and takes the reserve back.
        g.look();
        assert!(g.check().is_ok());
        assert!(d.join(RESERVE_FILE).exists());
    }
}
