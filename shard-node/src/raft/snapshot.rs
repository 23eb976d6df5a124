//! Snapshot files. The leader dumps the shard's state-machine records (`Store::dump_shard`)
//! into `gen-*.snap` at the applied index; the Raft snapshot message carries only a descriptor
//! (file size and CRC32) so that the bytes travel on their own flow-controlled stream. The
//! receiver writes `recv-*.tmp`, checks size and CRC32, and renames it to `recv-*.snap` before
//! Raft sees the message; a corrupted or truncated stream is rejected and Raft retries.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::error::{Result, ShardError};
use crate::storage::ShardKey;

/// What the Raft snapshot's `data` holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    pub size: u64,
    pub crc32: u32,
}

impl Descriptor {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = b"RCS1".to_vec();
        v.extend(self.size.to_be_bytes());
        v.extend(self.crc32.to_be_bytes());
        v
    }

    pub fn decode(b: &[u8]) -> Result<Self> {
        if b.len() != 16 || &b[..4] != b"RCS1" {
            return Err(ShardError::Corrupt("snapshot descriptor".into()));
        }
        Ok(Self {
            size: u64::from_be_bytes(b[4..12].try_into().unwrap_or_default()),
            crc32: u32::from_be_bytes(b[12..16].try_into().unwrap_or_default()),
        })
    }
}

fn name(kind: &str, key: &ShardKey, index: u64, term: u64, ext: &str) -> String {
    format!(
        "{kind}-{}-{}-{index}-{term}.{ext}",
        key.collection, key.shard
    )
}

pub fn generated_path(dir: &Path, key: &ShardKey, index: u64, term: u64) -> PathBuf {
    dir.join(name("gen", key, index, term, "snap"))
}

pub fn received_path(dir: &Path, key: &ShardKey, index: u64, term: u64) -> PathBuf {
    dir.join(name("recv", key, index, term, "snap"))
}

pub fn temp_path(dir: &Path, key: &ShardKey, index: u64, term: u64) -> PathBuf {
    dir.join(name("recv", key, index, term, "tmp"))
}

/// Removes this shard's files of `kind` other than `keep`.
pub fn remove_others(dir: &Path, kind: &str, key: &ShardKey, keep: Option<&Path>) {
    let prefix = format!("{kind}-{}-{}-", key.collection, key.shard);
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        let is_ours = e.file_name().to_string_lossy().starts_with(&prefix);
        if is_ours && Some(p.as_path()) != keep {
            let _ = std::fs::remove_file(&p);
        }
    }
}

/// A writer that counts bytes and computes the CRC32 of what passes through.
pub struct Checked<W> {
    inner: W,
    hasher: crc32fast::Hasher,
    size: u64,
}

impl<W: Write> Checked<W> {
    pub fn new(inner: W) -> Self {
        Self {
            inner,
            hasher: crc32fast::Hasher::new(),
            size: 0,
        }
    }

    pub fn finish(mut self) -> Result<(W, Descriptor)> {
        self.inner.flush()?;
        Ok((
            self.inner,
            Descriptor {
                size: self.size,
                crc32: self.hasher.finalize(),
            },
        ))
    }
}

impl<W: Write> Write for Checked<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.size += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Dumps the shard into `path` (through a temp file, fsync'd) and returns its descriptor.
pub fn generate(
    store: &crate::storage::Store,
    key: &ShardKey,
    path: &Path,
) -> Result<(Descriptor, u64)> {
    let tmp = path.with_extension("tmp");
    let file = std::fs::File::create(&tmp)?;
    let mut w = Checked::new(BufWriter::with_capacity(1 << 20, file));
    let records = store.dump_shard(key, &mut w)?;
    let (buf, desc) = w.finish()?;
    let file = buf
        .into_inner()
        .map_err(|e| ShardError::Io(e.into_error()))?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)?;
    Ok((desc, records))
}

/// Checks a file against its descriptor.
pub fn verify(path: &Path, desc: &Descriptor) -> Result<()> {
    let (size, crc32) = crate::checksum::file_crc32(path)?;
    let got = Descriptor { size, crc32 };
    if got != *desc {
        return Err(ShardError::Corrupt(format!(
            "snapshot {}: {} bytes crc {:08x}, expected {} bytes crc {:08x}",
            path.display(),
            got.size,
            got.crc32,
            desc.size,
            desc.crc32
        )));
    }
    Ok(())
}
