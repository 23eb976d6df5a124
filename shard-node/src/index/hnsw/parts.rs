//! The graph and its slot table as files in a dump directory (`dump` owns the directory's
//! lifecycle): hnsw_rs's own format for the graph, without the live points' vectors
//! (`vectors`), and a slot table of ours.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::path::Path;

use hnsw_rs::api::AnnT;
use hnsw_rs::hnswio::HnswIo;
use parking_lot::RwLock;

use super::graph::{Graph, HnswIndex, Slot, Slots};
use super::sq8::{self, Sq8Cosine};
use super::vectors::{self, FetchVectors};
use super::{CodeGraph, GRAPH_BASENAME, HnswParams, SLOTS_FILE};
use crate::error::{Result, ShardError};
use crate::index::filter::Value;

/// First word of a slot table with typed metadata (no count of slots comes near it).
const TYPED_SLOTS: u64 = 0x5459_5045_4453_4c31; // "TYPEDSL1"

fn put_value(out: &mut impl Write, v: &Value) -> std::io::Result<()> {
    match v {
        Value::Keyword(s) => {
            out.write_all(&[0])?;
            put_str(out, s)
        }
        Value::Number(x) => {
            out.write_all(&[1])?;
            out.write_all(&x.to_le_bytes())
        }
        Value::Bool(b) => out.write_all(&[2, u8::from(*b)]),
        Value::Keywords(list) => {
            out.write_all(&[3])?;
            out.write_all(&(list.len() as u32).to_le_bytes())?;
            list.iter().try_for_each(|s| put_str(out, s))
        }
    }
}

fn get_value(input: &mut impl Read) -> Result<Value> {
    Ok(match get_u8(input)? {
        0 => Value::Keyword(get_str(input)?),
        1 => Value::Number(f64::from_bits(get_u64(input)?)),
        2 => Value::Bool(get_u8(input)? == 1),
        3 => {
            let n = get_u32(input)? as usize;
            let mut list = Vec::with_capacity(n.min(1024));
            for _ in 0..n {
                list.push(get_str(input)?);
            }
            Value::Keywords(list)
        }
        t => return Err(ShardError::Corrupt(format!("slot value tag {t}"))),
    })
}

impl HnswIndex {
    /// Writes the graph (hnsw_rs's own format) and the slot table into the existing, empty
    /// directory `dir`. Holds the read locks throughout, so the files describe one state; the
    /// caller keeps writers away (the index worker is the only one). Returns the point count.
    /// Pending points are not written: the dump stands for `graph_through`, and the op log
    /// after it brings them back.
    pub fn write_parts(&self, dir: &Path) -> Result<usize> {
        let g = self.graph.read();
        let s = g.slots.read();
        let points = g.hnsw.get_nb_point();
        if points != s.slots.len() {
            return Err(ShardError::Corrupt(format!(
                "hnsw holds {points} points but {} slots",
                s.slots.len()
            )));
        }
        if points > 0 {
            g.hnsw
                .file_dump(dir, GRAPH_BASENAME)
                .map_err(|e| ShardError::Corrupt(format!("hnsw dump: {e}")))?;
            // Live points' vectors are in RocksDB: the dump keeps only the dead ones' codes.
            let alive = |id: usize| s.slots.get(id).is_some_and(|sl| sl.alive);
            vectors::strip(dir, GRAPH_BASENAME, self.dim, &alive)?;
        }
        let mut out = std::io::BufWriter::new(std::fs::File::create(dir.join(SLOTS_FILE))?);
        out.write_all(&TYPED_SLOTS.to_le_bytes())?;
        out.write_all(&(s.slots.len() as u64).to_le_bytes())?;
        for sl in &s.slots {
            out.write_all(&[u8::from(sl.alive)])?;
            put_str(&mut out, &sl.chunk_id)?;
            put_str(&mut out, &sl.doc_id)?;
            out.write_all(&(sl.meta.len() as u32).to_le_bytes())?;
            for (k, v) in &sl.meta {
                put_str(&mut out, k)?;
                put_value(&mut out, v)?;
            }
        }
        out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        Ok(points)
    }

    /// Reads what `write_parts` wrote, taking live points' vectors from `fetch`. The caller has
    /// checked the files' checksums; a panic in hnsw_rs's reader (it asserts on malformed input)
    /// still comes back as an error. Also returns the documents of live points whose vector
    /// changed since the dump (`hnsw::vectors`): the caller must re-index them.
    pub fn read_parts(
        dir: &Path,
        dim: usize,
        params: HnswParams,
        fetch: FetchVectors,
    ) -> Result<(Self, HashSet<String>)> {
        let corrupt = |m: String| ShardError::Corrupt(format!("hnsw dump {}: {m}", dir.display()));
        let mut input = std::io::BufReader::new(std::fs::File::open(dir.join(SLOTS_FILE))?);
        // Dumps written before typed metadata start with the count and hold keywords only.
        let first = get_u64(&mut input)?;
        let typed = first == TYPED_SLOTS;
        let n = if typed { get_u64(&mut input)? } else { first } as usize;
        let mut slots = Slots::default();
        for i in 0..n {
            let alive = get_u8(&mut input)? == 1;
            let chunk_id = get_str(&mut input)?;
            let doc_id = get_str(&mut input)?;
            let pairs = get_u32(&mut input)? as usize;
            let mut meta = Vec::with_capacity(pairs.min(1024));
            for _ in 0..pairs {
                let key = get_str(&mut input)?;
                let value = if typed {
                    get_value(&mut input)?
                } else {
                    Value::Keyword(get_str(&mut input)?)
                };
                meta.push((key, value));
            }
            if alive {
                slots.by_chunk.insert(chunk_id.clone(), i);
            } else {
                slots.dead += 1;
            }
            slots.push(Slot {
                chunk_id,
                doc_id,
                meta,
                vector: Box::default(),
                alive,
            });
        }
        if n == 0 {
            return Ok((Self::new(dim, params, 0), HashSet::new()));
        }
        let mut vectors: Vec<Option<Vec<f32>>> = vec![None; n];
        let chunk_id = |id: usize| slots.slots.get(id).map(|s| s.chunk_id.clone());
        let mut keep = |id: usize, v: Vec<f32>| {
            if let Some(slot) = vectors.get_mut(id) {
                *slot = Some(v);
            }
        };
        let r = vectors::restore(dir, GRAPH_BASENAME, dim, &chunk_id, fetch, &mut keep)?;
        if r.points != n {
            return Err(corrupt(format!("{} vectors for {n} slots", r.points)));
        }
        let stale: HashSet<String> = r
            .stale
            .iter()
            .filter_map(|&i| slots.slots.get(i).map(|s| s.doc_id.clone()))
            .collect();
        for (slot, v) in slots.slots.iter_mut().zip(vectors) {
            if slot.alive {
                slot.vector = v.unwrap_or_default().into_boxed_slice();
            }
        }
        let loaded = Self::load_graph(dir, dim, n);
        // Only a copy: the dump stays graph-only on disk.
        let _ = std::fs::remove_file(dir.join(vectors::data_file(GRAPH_BASENAME)));
        let hnsw = loaded.map_err(corrupt)?;
        Ok((
            Self {
                dim,
                params,
                graph: RwLock::new(Graph::new(hnsw, slots)),
                pending: RwLock::default(),
            },
            stale,
        ))
    }

    /// hnsw_rs's reader over the graph and data files in `dir`, checked against the slot count
    /// and code length.
    fn load_graph(dir: &Path, dim: usize, n: usize) -> std::result::Result<CodeGraph, String> {
        // A loaded graph borrows its loader for as long as it lives ('static here): the loader
        // is a few paths and flags, leaked once per load (at open).
        let io: &'static mut HnswIo = Box::leak(Box::new(HnswIo::new(dir, GRAPH_BASENAME)));
        let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let io = io;
            io.load_hnsw::<i8, Sq8Cosine>()
        }));
        let mut hnsw = match loaded {
            Ok(Ok(h)) => h,
            Ok(Err(e)) => return Err(e.to_string()),
            Err(_) => return Err("the graph reader panicked".into()),
        };
        hnsw.set_extend_candidates(false);
        if hnsw.get_nb_point() != n {
            return Err(format!(
                "graph holds {} points, slot table {n}",
                hnsw.get_nb_point()
            ));
        }
        let stored = hnsw.get_point_indexation().get_data_dimension();
        if stored != sq8::code_len(dim) {
            return Err(format!(
                "codes of {stored} bytes, shard expects {} (dimension {dim})",
                sq8::code_len(dim)
            ));
        }
        Ok(hnsw)
    }
}

fn put_str(out: &mut impl Write, s: &str) -> std::io::Result<()> {
    out.write_all(&(s.len() as u32).to_le_bytes())?;
    out.write_all(s.as_bytes())
}

fn get_u8(input: &mut impl Read) -> Result<u8> {
    let mut b = [0u8; 1];
    input.read_exact(&mut b)?;
    Ok(b[0])
}

fn get_u32(input: &mut impl Read) -> Result<u32> {
    let mut b = [0u8; 4];
    input.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn get_u64(input: &mut impl Read) -> Result<u64> {
    let mut b = [0u8; 8];
    input.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn get_str(input: &mut impl Read) -> Result<String> {
    let len = get_u32(input)? as usize;
    if len > 1 << 20 {
        return Err(ShardError::Corrupt(format!("slot string of {len} bytes")));
    }
    let mut b = vec![0u8; len];
    input.read_exact(&mut b)?;
    String::from_utf8(b).map_err(|_| ShardError::Corrupt("slot string is not UTF-8".into()))
}
