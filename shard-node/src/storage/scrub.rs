//! Checking RocksDB's files against their block checksums. RocksDB verifies a block only when
//! something reads it, so a flipped byte in a file no query touches stays hidden until a
//! compaction reaches it (and a compaction that meets it stops the database's writes). This
//! reads every block on purpose: at open, the files not verified since they were written
//! (`salvage::open_checked`); in the background, every file once per `scrub_interval` at
//! most `scrub_bytes_per_sec` (`Scrubber`). A damaged file is mapped to the shards whose keys
//! it holds: their replicas are taken out of service and rebuilt from their peers.
//!
//! The ledger `<data_dir>/rocksdb.scrub` remembers which files were verified (SST files never
//! change once written, so a verified name stays verified until the next pass) and which were
//! found damaged while the node ran, so the next open salvages the store without them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rocksdb::{Direction, IteratorMode, ReadOptions};

use super::{CF_META, ShardKey, Store};
use crate::error::Result;

/// One live SST file and the user keys it spans.
#[derive(Debug, Clone)]
pub struct SstFile {
    /// RocksDB's name, e.g. `/000012.sst`.
    pub name: String,
    pub cf: String,
    pub size: u64,
    pub start: Vec<u8>,
    pub end: Vec<u8>,
}

/// A file whose checksums do not hold, and what it holds.
#[derive(Debug, Clone)]
pub struct Damage {
    /// The file's path.
    pub file: String,
    /// RocksDB's words.
    pub error: String,
    /// Shards with keys in the file's range.
    pub shards: Vec<ShardKey>,
    /// Whether the node's own records (id, peers) may be in it.
    pub node_records: bool,
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "damaged file {}: {}", self.file, self.error)
    }
}

/// Sleeps as needed to keep reading under `rate` bytes a second (0: no limit), and tells a
/// pass to end early once `stop` is set.
pub struct Pace {
    rate: u64,
    started: Instant,
    bytes: u64,
    stop: Arc<AtomicBool>,
}

impl Pace {
    pub fn new(rate: u64) -> Self {
        Self::stoppable(rate, Arc::default())
    }

    pub fn stoppable(rate: u64, stop: Arc<AtomicBool>) -> Self {
        Self {
            rate,
            started: Instant::now(),
            bytes: 0,
            stop,
        }
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    fn add(&mut self, n: u64) {
        self.bytes += n;
        if self.rate == 0 {
            return;
        }
        let due = Duration::from_secs_f64(self.bytes as f64 / self.rate as f64);
        while let Some(wait) = due.checked_sub(self.started.elapsed()) {
            if self.stopped() || wait.is_zero() {
                return;
            }
            std::thread::sleep(wait.min(Duration::from_millis(100)));
        }
    }
}

impl Store {
    /// The live SST files of every column family.
    pub fn sst_files(&self) -> Result<Vec<SstFile>> {
        Ok(self
            .db
            .live_files()?
            .into_iter()
            .map(|f| SstFile {
                name: f.name,
                cf: f.column_family_name,
                size: f.size as u64,
                start: f.start_key.unwrap_or_default(),
                end: f.end_key.unwrap_or_default(),
            })
            .collect())
    }

    /// The data directory of the database (where its files are).
    pub fn path(&self) -> &Path {
        self.db.path()
    }

    /// Reads every key of `file`'s range in its family with block checksums verified (every
    /// block of the range is read, the file's among them), at `pace`. Returns the bytes read,
    /// or the damage: the file RocksDB names in its error (the one being verified if it names
    /// none) mapped to the shards in its range.
    pub fn verify_file(
        &self,
        file: &SstFile,
        shards: &[ShardKey],
        pace: &mut Pace,
    ) -> std::result::Result<u64, Damage> {
        let Some(cf) = self.db.cf_handle(&file.cf) else {
            return Ok(0);
        };
        let mut ro = ReadOptions::default();
        ro.set_verify_checksums(true);
        ro.fill_cache(false);
        ro.set_readahead_size(2 << 20);
        let mut upper = file.end.clone();
        upper.push(0);
        ro.set_iterate_upper_bound(upper);
        let mut read = 0u64;
        let mut step = 0u64;
        let it =
            self.db
                .iterator_cf_opt(cf, ro, IteratorMode::From(&file.start, Direction::Forward));
        for item in it {
            if pace.stopped() {
                break;
            }
            match item {
                Ok((k, v)) => {
                    let n = (k.len() + v.len()) as u64;
                    read += n;
                    step += n;
                    if step >= 256 << 10 {
                        pace.add(step);
                        step = 0;
                    }
                }
                Err(e) => return Err(self.damage(file, e.into_string(), shards)),
            }
        }
        pace.add(step);
        Ok(read)
    }

    /// The damage RocksDB's `error` describes, found while reading `file`'s range.
    fn damage(&self, file: &SstFile, error: String, shards: &[ShardKey]) -> Damage {
        let live = self.sst_files().unwrap_or_default();
        let named = sst_named_in(&error);
        let hit = named
            .as_deref()
            .and_then(|n| live.iter().find(|f| f.name.ends_with(n)))
            .unwrap_or(file);
        Damage {
            file: self
                .path()
                .join(hit.name.trim_start_matches('/'))
                .display()
                .to_string(),
            error,
            shards: overlapping(shards, &hit.start, &hit.end),
            node_records: hit.cf == CF_META && hit.end.as_slice() >= b"~".as_slice(),
        }
    }

    /// Verifies every live file the ledger does not list as verified (all of them with
    /// `again`), recording each one that holds; the first damage found ends the pass.
    pub fn verify_files(
        &self,
        ledger: &mut Ledger,
        shards: &[ShardKey],
        pace: &mut Pace,
        again: bool,
    ) -> std::result::Result<Scan, Damage> {
        let mut scan = Scan::default();
        let live = self.sst_files().map_err(|e| Damage {
            file: self.path().display().to_string(),
            error: e.to_string(),
            shards: shards.to_vec(),
            node_records: true,
        })?;
        for f in &live {
            let done = !again && ledger.verified.get(&f.name) == Some(&f.size);
            if done || ledger.damaged.contains_key(&f.name) || pace.stopped() {
                continue;
            }
            match self.verify_file(f, shards, pace) {
                Ok(n) => {
                    scan.bytes += n;
                    scan.files += 1;
                    ledger.verified.insert(f.name.clone(), f.size);
                }
                // Met again through another file's range: already reported.
                Err(d) if ledger.knows(&d) => {}
                Err(d) => return Err(d),
            }
        }
        ledger
            .verified
            .retain(|name, _| live.iter().any(|f| &f.name == name));
        Ok(scan)
    }
}

/// What one verification pass read.
#[derive(Debug, Default, Clone, Copy)]
pub struct Scan {
    pub files: u64,
    pub bytes: u64,
}

/// The shards among `shards` with keys between `start` and `end` (inclusive).
pub fn overlapping(shards: &[ShardKey], start: &[u8], end: &[u8]) -> Vec<ShardKey> {
    shards
        .iter()
        .filter(|k| k.prefix().as_slice() <= end && start < k.end().as_slice())
        .cloned()
        .collect()
}

/// The `NNNNNN.sst` an error message names, if any.
pub fn sst_named_in(error: &str) -> Option<String> {
    let at = error.find(".sst")?;
    let digits = error[..at]
        .bytes()
        .rev()
        .take_while(u8::is_ascii_digit)
        .count();
    (digits > 0).then(|| error[at - digits..at + 4].to_owned())
}

/// Which files were verified, and which were found damaged (see the module doc).
#[derive(Debug, Default)]
pub struct Ledger {
    path: PathBuf,
    /// File name -> size when verified.
    pub verified: HashMap<String, u64>,
    /// File name -> what was found.
    pub damaged: HashMap<String, String>,
}

impl Ledger {
    /// The ledger of the database at `db` (`<db>.scrub`); empty when there is none or it
    /// cannot be read (then every file is verified again: nothing is lost but time).
    pub fn load(db: &Path) -> Self {
        let path = db.with_extension("scrub");
        let mut l = Self {
            path,
            ..Default::default()
        };
        let text = std::fs::read_to_string(&l.path).unwrap_or_default();
        for line in text.lines() {
            let mut parts = line.splitn(3, ' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some("verified"), Some(name), Some(size)) => {
                    if let Ok(size) = size.parse() {
                        l.verified.insert(name.to_owned(), size);
                    }
                }
                (Some("damaged"), Some(name), Some(why)) => {
                    l.damaged.insert(name.to_owned(), why.to_owned());
                }
                _ => {}
            }
        }
        l
    }

    /// Writes the ledger (a temporary file renamed over the old one).
    pub fn save(&self) -> std::io::Result<()> {
        let mut text = String::new();
        for (name, size) in &self.verified {
            text.push_str(&format!("verified {name} {size}\n"));
        }
        for (name, why) in &self.damaged {
            text.push_str(&format!("damaged {name} {}\n", why.replace('\n', " ")));
        }
        let tmp = self.path.with_extension("scrub.tmp");
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, &self.path)
    }

    /// Records a damaged file (by its RocksDB name) so the next open salvages the store.
    pub fn mark_damaged(&mut self, d: &Damage) {
        let name = rocksdb_name(&d.file);
        self.verified.remove(&name);
        self.damaged.insert(name, d.error.clone());
    }

    fn knows(&self, d: &Damage) -> bool {
        self.damaged.contains_key(&rocksdb_name(&d.file))
    }
}

/// `/000012.sst` for `/data/rocksdb/000012.sst` (how `live_files` names it).
fn rocksdb_name(path: &str) -> String {
    Path::new(path)
        .file_name()
        .map(|n| format!("/{}", n.to_string_lossy()))
        .unwrap_or_else(|| path.to_owned())
}

/// The background scrub: one pass over every live file per `interval`, at most `rate` bytes a
/// second. A damaged file is recorded in the ledger (the next open salvages the store without
/// it), counted, and handed to `on_damage`, which takes the replicas in it out of service.
pub struct Scrubber {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Scrubber {
    pub fn spawn(
        store: Arc<Store>,
        interval: Duration,
        rate: u64,
        shards: impl Fn() -> Vec<ShardKey> + Send + 'static,
        on_damage: impl Fn(&Damage) + Send + 'static,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("scrub".into())
            .spawn(move || {
                let mut ledger = Ledger::load(store.path());
                while !sleep_unless(&flag, interval) {
                    let started = Instant::now();
                    let mut pace = Pace::stoppable(rate, flag.clone());
                    match store.verify_files(&mut ledger, &shards(), &mut pace, true) {
                        Ok(scan) => {
                            metrics::counter!("shard_scrub_files_total").increment(scan.files);
                            metrics::counter!("shard_scrub_bytes_total").increment(scan.bytes);
                            metrics::counter!("shard_scrub_passes_total").increment(1);
                            tracing::debug!(files = scan.files, bytes = scan.bytes,
                                ms = started.elapsed().as_millis() as u64, "scrub pass done");
                        }
                        Err(d) => {
                            metrics::counter!("shard_scrub_damaged_files_total").increment(1);
                            tracing::error!(file = %d.file, error = %d.error,
                                shards = ?d.shards.iter().map(ToString::to_string).collect::<Vec<_>>(),
                                "scrub found a damaged file; its replicas go out of service");
                            ledger.mark_damaged(&d);
                            store.mark_damaged();
                            on_damage(&d);
                        }
                    }
                    if let Err(e) = ledger.save() {
                        tracing::warn!(error = %e, "could not save the scrub ledger");
                    }
                }
            })?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Scrubber {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Sleeps `d` in steps; true once `stop` is set.
fn sleep_unless(stop: &AtomicBool, d: Duration) -> bool {
    let until = Instant::now() + d;
    while Instant::now() < until {
        if stop.load(Ordering::Acquire) {
            return true;
        }
        std::thread::sleep((until - Instant::now()).min(Duration::from_millis(100)));
    }
    stop.load(Ordering::Acquire)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sst_names_are_found_in_rocksdb_errors() {
        let e = "Corruption: block checksum mismatch: stored = 1, computed = 2, type = 1  in \
                 /d/rocksdb/000012.sst offset 0 size 4011";
        assert_eq!(sst_named_in(e).as_deref(), Some("000012.sst"));
        assert_eq!(sst_named_in("IO error: no space left"), None);
    }

    #[test]
    fn a_file_range_maps_to_the_shards_it_overlaps() {
        let shards = [
            ShardKey::new("a", 0),
            ShardKey::new("a", 1),
            ShardKey::new("b", 0),
        ];
        let one = ShardKey::new("a", 1);
        let mut end = one.prefix();
        end.extend_from_slice(b"zzz");
        let hit = overlapping(&shards, &ShardKey::new("a", 0).key(b"q"), &end);
        assert_eq!(hit, vec![ShardKey::new("a", 0), one]);
        assert!(overlapping(&shards, b"~node/id", b"~node/peers").is_empty());
    }
}
