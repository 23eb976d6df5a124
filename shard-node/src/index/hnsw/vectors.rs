//! HNSW dumps without a second copy of the vectors.
//!
//! hnsw_rs dumps a graph as two files: the topology (`.hnsw.graph`) and every point's data
//! (`.hnsw.data`), here the int8 code of its vector (`sq8`). The vectors of live chunks are
//! already in RocksDB's `vectors` family, and a code is a function of its vector, so keeping
//! the data file would store each vector twice per replica. At dump time [`strip`] replaces the
//! data file by an order file (which point comes next in the data file, and a CRC of its code)
//! and the codes of dead slots only (tombstones whose vectors RocksDB no longer holds); at load
//! [`restore`] encodes the live points' vectors from RocksDB into the data file again, in that
//! order, for hnsw_rs to read (it is removed again after loading), and hands the vectors to
//! the index, which rescores hits with them.
//!
//! The data file's layout (hnsw_rs 0.3, format version 3/4): a header of a magic `u32` and
//! the dimension as `usize` (the code length: `i8` elements), then per point the magic, the
//! point's id (`u64`), the byte length of its data (`u64`) and the code's bytes. [`strip`]
//! checks every field it relies on, so a different layout fails the dump (the previous dump
//! stays) instead of producing a wrong one.
//!
//! A live point whose vector changed or went after the dump (its document was rewritten, so
//! the op log catch-up tombstones it) is restored as an all-zero code: distance 1 from every
//! query, so walks do not go through it. Its document is reported, and the caller rejects the
//! dump unless the catch-up covers that document.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use super::sq8;
use crate::error::{Result, ShardError};

/// The order of points in the data file, with a CRC of each point's code.
pub const ORDER_FILE: &str = "vectors.order";
/// The codes of dead slots, in data-file order.
pub const DEAD_FILE: &str = "vectors.dead";
/// hnsw_rs's data file for `basename`.
pub fn data_file(basename: &str) -> String {
    format!("{basename}.hnsw.data")
}

/// Header of the data file: magic `u32` and dimension `usize`, kept verbatim.
const HEADER: usize = 4 + std::mem::size_of::<usize>();
/// Points fetched from RocksDB at once while restoring.
const FETCH_BATCH: usize = 1024;

const FROM_STORE: u8 = 0;
const DEAD: u8 = 1;

/// Fetches the stored vectors of chunk ids (None: no vector stored any more).
pub type FetchVectors<'a> = &'a dyn Fn(&[String]) -> Result<Vec<Option<Vec<f32>>>>;

fn corrupt(what: impl std::fmt::Display) -> ShardError {
    ShardError::Corrupt(format!("hnsw vectors: {what}"))
}

/// Replaces the data file in `dir` by [`ORDER_FILE`] and [`DEAD_FILE`]. `dim` is the vectors'
/// dimension; `alive(id)` says whether point `id` (a slot index) is a live chunk whose vector
/// RocksDB holds.
pub fn strip(dir: &Path, basename: &str, dim: usize, alive: &dyn Fn(usize) -> bool) -> Result<()> {
    let code_len = sq8::code_len(dim);
    let data_path = dir.join(data_file(basename));
    let mut input = BufReader::with_capacity(1 << 20, File::open(&data_path)?);
    let mut header = [0u8; HEADER];
    input.read_exact(&mut header)?;
    let magic = u32::from_ne_bytes(header[..4].try_into().expect("4 bytes"));
    let stored = usize::from_ne_bytes(header[4..].try_into().expect("usize"));
    if stored != code_len {
        return Err(corrupt(format!(
            "data file holds {stored}-byte codes, index {code_len} (dimension {dim})"
        )));
    }
    let mut order = BufWriter::new(File::create(dir.join(ORDER_FILE))?);
    let mut dead = BufWriter::new(File::create(dir.join(DEAD_FILE))?);
    order.write_all(&header)?;
    let mut body = vec![0u8; code_len];
    let mut points = 0u64;
    let mut records = Vec::new();
    loop {
        let mut m = [0u8; 4];
        match input.read_exact(&mut m) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e.into()),
        }
        let mut ids = [0u8; 16];
        input.read_exact(&mut ids)?;
        let id = u64::from_ne_bytes(ids[..8].try_into().expect("8 bytes"));
        let len = u64::from_ne_bytes(ids[8..].try_into().expect("8 bytes"));
        if u32::from_ne_bytes(m) != magic || len != body.len() as u64 {
            return Err(corrupt(format!(
                "point {points}: unexpected record (magic {:08x}, {len} bytes)",
                u32::from_ne_bytes(m)
            )));
        }
        input.read_exact(&mut body)?;
        let flag = if alive(id as usize) { FROM_STORE } else { DEAD };
        if flag == DEAD {
            dead.write_all(&body)?;
        }
        records.extend_from_slice(&id.to_le_bytes());
        records.push(flag);
        records.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        points += 1;
    }
    order.write_all(&points.to_le_bytes())?;
    order.write_all(&records)?;
    order.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    dead.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    std::fs::remove_file(&data_path)?;
    Ok(())
}

/// What [`restore`] found.
pub struct Restored {
    /// Points written to the data file.
    pub points: usize,
    /// Slots of live points whose stored vector is missing or differs from the dump's.
    pub stale: Vec<usize>,
}

/// Writes the data file back into `dir` from [`ORDER_FILE`], [`DEAD_FILE`] and the vectors
/// `fetch` returns for the live points' chunk ids (`chunk_id(slot)`) of dimension `dim`; each
/// live point's vector goes to `keep(slot, vector)`, except stale ones (the catch-up replaces
/// them; until then they score 0).
pub fn restore(
    dir: &Path,
    basename: &str,
    dim: usize,
    chunk_id: &dyn Fn(usize) -> Option<String>,
    fetch: FetchVectors,
    keep: &mut dyn FnMut(usize, Vec<f32>),
) -> Result<Restored> {
    let code_len = sq8::code_len(dim);
    let mut order = BufReader::new(File::open(dir.join(ORDER_FILE))?);
    let mut header = [0u8; HEADER];
    order.read_exact(&mut header)?;
    let magic = header[..4].to_vec();
    let stored = usize::from_ne_bytes(header[4..].try_into().expect("usize"));
    if stored != code_len {
        return Err(corrupt(format!(
            "dump holds {stored}-element points, index expects {code_len}-byte codes"
        )));
    }
    let mut n = [0u8; 8];
    order.read_exact(&mut n)?;
    let points = u64::from_le_bytes(n) as usize;
    let mut dead = BufReader::new(File::open(dir.join(DEAD_FILE))?);
    let mut out = BufWriter::with_capacity(1 << 20, File::create(dir.join(data_file(basename)))?);
    out.write_all(&header)?;
    let mut stale = Vec::new();
    let mut batch: Vec<(u64, u8, u32)> = Vec::with_capacity(FETCH_BATCH);
    let mut body = vec![0u8; code_len];
    let mut done = 0;
    while done < points {
        batch.clear();
        while batch.len() < FETCH_BATCH && done + batch.len() < points {
            let mut r = [0u8; 13];
            order.read_exact(&mut r)?;
            let id = u64::from_le_bytes(r[..8].try_into().expect("8 bytes"));
            let crc = u32::from_le_bytes(r[9..].try_into().expect("4 bytes"));
            batch.push((id, r[8], crc));
        }
        let ids = batch
            .iter()
            .filter(|r| r.1 == FROM_STORE)
            .map(|r| chunk_id(r.0 as usize).ok_or_else(|| corrupt(format!("no slot {}", r.0))))
            .collect::<Result<Vec<_>>>()?;
        let mut stored = fetch(&ids)?.into_iter();
        for &(id, flag, crc) in &batch {
            if flag == DEAD {
                dead.read_exact(&mut body)?;
            } else {
                let v = stored.next().flatten().filter(|v| v.len() == dim);
                body.clear();
                if let Some(v) = &v {
                    body.extend(sq8::encode(v).into_iter().map(|q| q as u8));
                }
                match v {
                    Some(v) if body.len() == code_len && crc32fast::hash(&body) == crc => {
                        keep(id as usize, v)
                    }
                    _ => {
                        stale.push(id as usize);
                        body.clear();
                        body.resize(code_len, 0);
                    }
                }
            }
            out.write_all(&magic)?;
            out.write_all(&id.to_ne_bytes())?;
            out.write_all(&(body.len() as u64).to_ne_bytes())?;
            out.write_all(&body)?;
        }
        done += batch.len();
    }
    out.flush()?;
    Ok(Restored { points, stale })
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use super::*;
    use crate::index::hnsw::tests::unit;
    use crate::index::hnsw::{GRAPH_BASENAME, HnswIndex, HnswParams, Point};

    const DIM: usize = 32;

    fn point(i: u32, seed: u32) -> Point {
        Point {
            chunk_id: format!("d{i}#0"),
            doc_id: format!("d{i}"),
            vector: unit(seed, DIM),
            meta: vec![],
        }
    }

    fn hits(idx: &HnswIndex, q: &[f32]) -> Vec<(String, f32)> {
        idx.search(q, 5, 64, &crate::index::Filter::default())
    }

    /// The dump keeps dead points' vectors only; loading with RocksDB's vectors gives back
    /// the same graph; vectors that changed after the dump are reported.
    #[test]
    fn dumps_keep_only_dead_vectors_and_load_back_the_same_graph() {
        let params = HnswParams {
            m: 16,
            ef_construction: 100,
            ef_search: 64,
        };
        let idx = HnswIndex::new(DIM, params, 300);
        idx.insert((0..300).map(|i| point(i, i)).collect());
        // d0..d9 get new vectors (their old points stay as tombstones), d10 is deleted.
        idx.insert((0..10).map(|i| point(i, 1000 + i)).collect());
        idx.remove(&["d10#0".to_string()]);
        let mut stored: HashMap<String, Vec<f32>> = (0..300)
            .filter(|&i| i != 10)
            .map(|i| {
                (
                    format!("d{i}#0"),
                    unit(if i < 10 { 1000 + i } else { i }, DIM),
                )
            })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(idx.write_parts(dir.path()).unwrap(), 310);
        let data = dir.path().join(data_file(GRAPH_BASENAME));
        assert!(!data.exists(), "no second copy of the vectors");
        let dead_len = std::fs::metadata(dir.path().join(DEAD_FILE)).unwrap().len();
        assert_eq!(
            dead_len,
            11 * sq8::code_len(DIM) as u64,
            "the 11 dead points' codes"
        );

        let load = |stored: &HashMap<String, Vec<f32>>| {
            let fetch = |ids: &[String]| Ok(ids.iter().map(|id| stored.get(id).cloned()).collect());
            HnswIndex::read_parts(dir.path(), DIM, params, &fetch).unwrap()
        };
        let (back, stale) = load(&stored);
        assert!(stale.is_empty());
        assert!(
            !data.exists(),
            "the restored data file is removed after loading"
        );
        assert_eq!(back.counts(), idx.counts());
        for seed in (0..300).step_by(7).chain(1000..1010) {
            let q = unit(seed, DIM);
            assert_eq!(hits(&back, &q), hits(&idx, &q), "query {seed}");
        }

        // d20's vector changed and d21's went after the dump: both reported, neither found.
        stored.insert("d20#0".into(), unit(5000, DIM));
        stored.remove("d21#0");
        let (back, stale) = load(&stored);
        let want: HashSet<String> = ["d20".to_string(), "d21".to_string()].into();
        assert_eq!(stale, want);
        assert!(hits(&back, &unit(5000, DIM)).iter().all(|h| h.1 < 0.99));
    }

    /// A data file that does not look like hnsw_rs 0.3's fails the dump instead of being
    /// misread.
    #[test]
    fn an_unknown_data_layout_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = 0xa67f0000u32.to_ne_bytes().to_vec();
        bytes.extend_from_slice(&sq8::code_len(DIM).to_ne_bytes());
        bytes.extend_from_slice(&0xa67f0000u32.to_ne_bytes());
        bytes.extend_from_slice(&7u64.to_ne_bytes());
        bytes.extend_from_slice(&(DIM as u64 * 2).to_ne_bytes());
        bytes.extend_from_slice(&[0u8; DIM * 2]);
        std::fs::write(dir.path().join(data_file("g")), bytes).unwrap();
        let err = strip(dir.path(), "g", DIM, &|_| true).unwrap_err();
        assert!(err.to_string().contains("unexpected record"), "{err}");
        let err = strip(dir.path(), "g", DIM + 1, &|_| true).unwrap_err();
        assert!(err.to_string().contains("dimension"), "{err}");
    }
}
