//! A log in memory with the semantics of `RocksLog`, for tests and the deterministic
//! simulation. The `MemDisk` behind it is shared: a simulated crash drops the member and keeps
//! the disk, so a restarted member finds exactly what was written.

use std::sync::Arc;

use parking_lot::Mutex;
use raft::eraftpb::{ConfState, Entry, HardState};

use super::{LogStore, Persisted};
use crate::error::Fatal;

#[derive(Debug, Default, Clone)]
pub struct MemDisk {
    pub hs: HardState,
    pub cs: ConfState,
    pub truncated_index: u64,
    pub truncated_term: u64,
    /// Entries after `truncated_index`, contiguous.
    pub entries: Vec<Entry>,
}

#[derive(Clone, Default)]
pub struct MemLog {
    pub disk: Arc<Mutex<MemDisk>>,
}

impl MemLog {
    /// A fresh group with `cs` as its first members.
    pub fn new(cs: ConfState) -> Self {
        Self {
            disk: Arc::new(Mutex::new(MemDisk {
                cs,
                ..Default::default()
            })),
        }
    }
}

impl LogStore for MemLog {
    fn load(&self) -> Result<Persisted, Fatal> {
        let d = self.disk.lock();
        Ok(Persisted {
            hs: d.hs.clone(),
            cs: d.cs.clone(),
            truncated_index: d.truncated_index,
            truncated_term: d.truncated_term,
            last_index: d.entries.last().map_or(d.truncated_index, |e| e.index),
        })
    }

    fn entries(&self, lo: u64, hi: u64, max_size: Option<u64>) -> Result<Vec<Entry>, Fatal> {
        let d = self.disk.lock();
        let first = d.truncated_index + 1;
        if lo < first || hi > first + d.entries.len() as u64 {
            return Err(Fatal(format!("entries [{lo}, {hi}) outside the log")));
        }
        let mut out = Vec::new();
        let mut size = 0u64;
        for e in &d.entries[(lo - first) as usize..(hi - first) as usize] {
            size += e.data.len() as u64;
            if !out.is_empty() && max_size.is_some_and(|m| size > m) {
                break;
            }
            out.push(e.clone());
        }
        Ok(out)
    }

    fn term(&self, index: u64) -> Result<Option<u64>, Fatal> {
        let d = self.disk.lock();
        Ok(index
            .checked_sub(d.truncated_index + 1)
            .and_then(|i| d.entries.get(i as usize))
            .map(|e| e.term))
    }

    fn append(
        &mut self,
        entries: &[Entry],
        _old_last: u64,
        hs: Option<&HardState>,
    ) -> Result<(), Fatal> {
        let mut d = self.disk.lock();
        if let Some(first) = entries.first() {
            if first.index <= d.truncated_index {
                return Err(Fatal(format!("append at {} below the log", first.index)));
            }
            let keep = (first.index - d.truncated_index - 1) as usize;
            if keep > d.entries.len() {
                return Err(Fatal(format!("append at {} leaves a gap", first.index)));
            }
            d.entries.truncate(keep);
            d.entries.extend_from_slice(entries);
        }
        if let Some(hs) = hs {
            d.hs = hs.clone();
        }
        Ok(())
    }

    fn set_hard_state(&mut self, hs: &HardState) -> Result<(), Fatal> {
        self.disk.lock().hs = hs.clone();
        Ok(())
    }

    fn compact(&mut self, index: u64, term: u64) -> Result<(), Fatal> {
        let mut d = self.disk.lock();
        let drop = (index.saturating_sub(d.truncated_index) as usize).min(d.entries.len());
        d.entries.drain(..drop);
        d.truncated_index = index;
        d.truncated_term = term;
        Ok(())
    }

    fn reset(
        &mut self,
        index: u64,
        term: u64,
        cs: &ConfState,
        hs: &HardState,
    ) -> Result<(), Fatal> {
        let mut d = self.disk.lock();
        d.entries.clear();
        d.truncated_index = index;
        d.truncated_term = term;
        d.cs = cs.clone();
        d.hs = hs.clone();
        Ok(())
    }
}
