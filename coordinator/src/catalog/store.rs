//! Durable home of the catalog group: Raft log entries, hard state and the applied catalog,
//! in a small RocksDB under `data_dir/catalog`. raft-rs reads the log from a `MemStorage`
//! mirror rebuilt from here at start. The catalog is small and changes rarely, so every write
//! is synced before it is acknowledged.

use std::path::Path;

use prost::Message as _;
use protobuf::Message as _;
use raft::eraftpb::{Entry, HardState};
use ragcluster_proto::v1::CatalogState;
use rocksdb::{DB, Options, WriteBatch, WriteOptions};

use crate::error::{CoordError, Result};

const HARD_STATE: &[u8] = b"hs";
const STATE: &[u8] = b"st";

fn entry_key(index: u64) -> [u8; 9] {
    let mut k = [b'e'; 9];
    k[1..].copy_from_slice(&index.to_be_bytes());
    k
}

fn err(what: &str, e: impl std::fmt::Display) -> CoordError {
    CoordError::Catalog(format!("{what}: {e}"))
}

pub struct CatalogStore {
    db: DB,
}

/// What the store holds at start.
pub struct Loaded {
    pub hard_state: HardState,
    pub state: CatalogState,
    /// Entries after the applied index, contiguous.
    pub entries: Vec<Entry>,
}

impl CatalogStore {
    pub fn open(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| err(&dir.display().to_string(), e))?;
        let mut o = Options::default();
        o.create_if_missing(true);
        o.set_max_open_files(64);
        o.set_keep_log_file_num(4);
        let db = DB::open(&o, dir).map_err(|e| err(&dir.display().to_string(), e))?;
        Ok(Self { db })
    }

    fn write(&self, b: WriteBatch) -> Result<()> {
        let mut w = WriteOptions::default();
        w.set_sync(true);
        self.db.write_opt(b, &w).map_err(|e| err("write", e))
    }

    pub fn load(&self) -> Result<Loaded> {
        let get = |k: &[u8]| self.db.get(k).map_err(|e| err("read", e));
        let mut hard_state = HardState::default();
        if let Some(b) = get(HARD_STATE)? {
            hard_state
                .merge_from_bytes(&b)
                .map_err(|e| err("hard state", e))?;
        }
        let state = match get(STATE)? {
            Some(b) => CatalogState::decode(&*b).map_err(|e| err("applied state", e))?,
            None => CatalogState::default(),
        };
        let mut entries: Vec<Entry> = Vec::new();
        let from = entry_key(state.applied_index + 1);
        let iter = self.db.iterator(rocksdb::IteratorMode::From(
            &from,
            rocksdb::Direction::Forward,
        ));
        for kv in iter {
            let (k, v) = kv.map_err(|e| err("read log", e))?;
            if k.first() != Some(&b'e') {
                break;
            }
            let mut e = Entry::default();
            e.merge_from_bytes(&v).map_err(|e| err("log entry", e))?;
            if let Some(prev) = entries.last()
                && e.index != prev.index + 1
            {
                return Err(err(
                    "log",
                    format!("gap between entries {} and {}", prev.index, e.index),
                ));
            }
            entries.push(e);
        }
        Ok(Loaded {
            hard_state,
            state,
            entries,
        })
    }

    /// Appends entries (replacing any conflicting suffix) and/or a new hard state, synced.
    pub fn append(&self, entries: &[Entry], hs: Option<&HardState>) -> Result<()> {
        let mut b = WriteBatch::default();
        if let Some(first) = entries.first() {
            b.delete_range(entry_key(first.index), entry_key(u64::MAX));
            for e in entries {
                let v = e.write_to_bytes().map_err(|e| err("encode entry", e))?;
                b.put(entry_key(e.index), v);
            }
        }
        if let Some(hs) = hs {
            b.put(
                HARD_STATE,
                hs.write_to_bytes()
                    .map_err(|e| err("encode hard state", e))?,
            );
        }
        self.write(b)
    }

    /// Persists the catalog as of its applied index and drops the log up to `compact_below`.
    pub fn put_state(&self, st: &CatalogState, compact_below: Option<u64>) -> Result<()> {
        let mut b = WriteBatch::default();
        b.put(STATE, st.encode_to_vec());
        if let Some(i) = compact_below {
            b.delete_range(entry_key(0), entry_key(i));
        }
        self.write(b)
    }

    /// A snapshot from the leader replaces the whole log and the catalog.
    pub fn install(&self, st: &CatalogState, hs: &HardState) -> Result<()> {
        let mut b = WriteBatch::default();
        b.delete_range(entry_key(0), entry_key(u64::MAX));
        b.put(STATE, st.encode_to_vec());
        b.put(
            HARD_STATE,
            hs.write_to_bytes()
                .map_err(|e| err("encode hard state", e))?,
        );
        self.write(b)
    }
}
