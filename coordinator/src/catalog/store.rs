//! Durable home of the catalog group, a small RocksDB under `data_dir/catalog`: the applied
//! catalog (`st` in the default family) and the group's Raft log (`ragcluster_raft::RocksLog`
//! in the `raft` family). The catalog is small and changes rarely, so every write is synced
//! before it is acknowledged.

use std::path::Path;
use std::sync::Arc;

use prost::Message as _;
use protobuf::Message as _;
use ragcluster_proto::v1::CatalogState;
use ragcluster_raft::eraftpb::{ConfState, Entry, HardState};
use ragcluster_raft::{Keys, RocksLog};
use rocksdb::{DB, Options, WriteBatch, WriteOptions};

use crate::error::{CoordError, Result};

const STATE: &[u8] = b"st";
const RAFT: &str = "raft";
/// Keys of the layout before the shared Raft core (log in the default family).
const OLD_HARD_STATE: &[u8] = b"hs";

fn err(what: &str, e: impl std::fmt::Display) -> CoordError {
    CoordError::Catalog(format!("{what}: {e}"))
}

pub struct CatalogStore {
    db: Arc<DB>,
    keys: Keys,
}

impl CatalogStore {
    pub fn open(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| err(&dir.display().to_string(), e))?;
        let mut o = Options::default();
        o.create_if_missing(true);
        o.create_missing_column_families(true);
        o.set_max_open_files(64);
        o.set_keep_log_file_num(4);
        let db = DB::open_cf(&o, dir, [RAFT]).map_err(|e| err(&dir.display().to_string(), e))?;
        Ok(Self {
            db: Arc::new(db),
            keys: Keys::new(Vec::new()),
        })
    }

    fn raft_cf(&self) -> Result<&rocksdb::ColumnFamily> {
        self.db
            .cf_handle(RAFT)
            .ok_or_else(|| CoordError::Catalog("column family raft missing".into()))
    }

    fn write(&self, b: WriteBatch) -> Result<()> {
        let mut w = WriteOptions::default();
        w.set_sync(true);
        self.db.write_opt(b, &w).map_err(|e| err("write", e))
    }

    /// The group's Raft log.
    pub fn log(&self) -> RocksLog {
        RocksLog::new(self.db.clone(), RAFT, Vec::new(), true)
    }

    pub fn load_state(&self) -> Result<CatalogState> {
        match self.db.get(STATE).map_err(|e| err("read", e))? {
            Some(b) => CatalogState::decode(&*b).map_err(|e| err("applied state", e)),
            None => Ok(CatalogState::default()),
        }
    }

    /// Makes the log ready for a group of `voters` (the configured coordinators): carries a
    /// log of the earlier layout over, initialises a new one, and records `voters` when the
    /// configuration changed them (membership is static: it comes from the config).
    pub fn prepare(&self, voters: &[u64]) -> Result<()> {
        let log = self.log();
        let cs = ConfState {
            voters: voters.to_vec(),
            ..Default::default()
        };
        if self
            .db
            .get(OLD_HARD_STATE)
            .map_err(|e| err("read", e))?
            .is_some()
        {
            return self.migrate(&cs);
        }
        if !log.exists().map_err(|e| err("raft log", e))? {
            return log.init(&cs).map_err(|e| err("raft log", e));
        }
        let persisted = ragcluster_raft::LogStore::load(&log).map_err(|e| err("raft log", e))?;
        let mut had = persisted.cs.voters.clone();
        had.sort_unstable();
        if had != voters {
            tracing::info!(from = ?had, to = ?voters, "catalog members changed in the config");
            let mut b = WriteBatch::default();
            b.put_cf(self.raft_cf()?, self.keys.conf_state(), pb(&cs)?);
            self.write(b)?;
        }
        Ok(())
    }

    /// Moves a catalog written before the shared Raft core (entries `e<index>` and `hs` in the
    /// default family) into the `raft` family, in one write.
    fn migrate(&self, cs: &ConfState) -> Result<()> {
        let st = self.load_state()?;
        let cf = self.raft_cf()?;
        let mut b = WriteBatch::default();
        let hs_bytes = self
            .db
            .get(OLD_HARD_STATE)
            .map_err(|e| err("read", e))?
            .unwrap_or_default();
        let mut hs = HardState::default();
        hs.merge_from_bytes(&hs_bytes)
            .map_err(|e| err("hard state", e))?;
        self.keys
            .reset_into(&mut b, cf, st.applied_index, st.applied_term, cs, &hs)
            .map_err(|e| err("raft log", e))?;
        let mut moved = 0;
        for kv in self.db.prefix_iterator(b"e") {
            let (k, v) = kv.map_err(|e| err("read log", e))?;
            if k.first() != Some(&b'e') || k.len() != 9 {
                break;
            }
            let mut e = Entry::default();
            e.merge_from_bytes(&v).map_err(|e| err("log entry", e))?;
            if e.index > st.applied_index {
                b.put_cf(cf, self.keys.entry(e.index), &v);
                moved += 1;
            }
            b.delete(&k);
        }
        b.delete(OLD_HARD_STATE);
        self.write(b)?;
        tracing::info!(
            applied = st.applied_index,
            entries = moved,
            "catalog log moved to the shared raft layout"
        );
        Ok(())
    }

    /// Persists the catalog as of its applied index (with the conf state of a membership
    /// change applied at that index).
    pub fn put_state(&self, st: &CatalogState, conf: Option<&ConfState>) -> Result<()> {
        let mut b = WriteBatch::default();
        b.put(STATE, st.encode_to_vec());
        if let Some(cs) = conf {
            b.put_cf(self.raft_cf()?, self.keys.conf_state(), pb(cs)?);
        }
        self.write(b)
    }

    /// A snapshot from the leader replaces the catalog and resets the log, in one write.
    pub fn install(&self, st: &CatalogState, cs: &ConfState, hs: &HardState) -> Result<()> {
        let mut b = WriteBatch::default();
        b.put(STATE, st.encode_to_vec());
        self.keys
            .reset_into(
                &mut b,
                self.raft_cf()?,
                st.applied_index,
                st.applied_term,
                cs,
                hs,
            )
            .map_err(|e| err("raft log", e))?;
        self.write(b)
    }
}

fn pb(m: &impl protobuf::Message) -> Result<Vec<u8>> {
    m.write_to_bytes().map_err(|e| err("encode", e))
}
