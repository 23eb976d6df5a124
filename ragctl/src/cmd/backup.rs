//! `ragctl backup create|restore|verify`: a cluster's collections saved to a directory and
//! brought back, possibly into another cluster with any number of shard nodes.
//!
//! A backup is one directory: `manifest.json` (written last: a directory without it is not a
//! backup), and per collection `collection.pb` (its `CollectionInfo`: shard count, chunking,
//! embedding model, HNSW parameters, schema) and one file per shard, `shard-NNNN.pb`, the
//! shard's documents as length-delimited `DocumentWrite` messages (chunks with their vectors
//! and model revisions), exported by the shard from one RocksDB snapshot after a read index
//! (`Admin.BackupShard`). Each shard's `seq` in the manifest is the backup's token for it:
//! every write acknowledged before its export began is in the file. The manifest lists every
//! file with its size and sha256; a restore checks them all before it creates anything, then
//! creates each collection from its saved info, writes the documents back
//! (`Admin.RestoreDocuments`: nothing is chunked or embedded again) and the aliases last.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail, ensure};
use clap::{Args, Subcommand};
use futures::StreamExt;
use prost::Message;
use ragcluster_common::client::KeyedChannel;
use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{Cli, channel};

const FORMAT: &str = "ragcluster-backup/1";
const MANIFEST: &str = "manifest.json";
/// What a restore call carries at most (the coordinator takes 64 MiB).
const RESTORE_CALL_BYTES: usize = 16 << 20;
/// Backed-up messages a gRPC client takes (a document's chunks travel whole).
const MAX_MESSAGE: usize = 64 << 20;

#[derive(Subcommand)]
pub enum BackupCmd {
    /// Save collections and their aliases to a directory: each shard as of one moment (after
    /// a read index, so every acknowledged write is in it) while writes go on; every file
    /// checksummed in the manifest.
    Create(CreateArgs),
    /// Bring a backup into a cluster that has none of its collections or aliases (any number
    /// of shard nodes): every file's size and sha256 are checked before anything is created.
    Restore(RestoreArgs),
    /// Check a backup's files against its manifest (size and sha256); no cluster needed.
    Verify {
        /// The backup directory.
        dir: PathBuf,
    },
}

#[derive(Args)]
pub struct CreateArgs {
    /// Directory to write (created; it must be absent or empty).
    #[arg(long)]
    to: PathBuf,
    /// Write into a new directory under --to named after the time
    /// (`backup-20261205T053000Z`), for scheduled backups (the Helm chart's CronJob).
    #[arg(long)]
    stamp: bool,
    /// With --stamp: afterwards keep only the newest N complete backups under --to.
    #[arg(long, requires = "stamp")]
    keep: Option<usize>,
    /// Only these collections (names or aliases; repeat the flag); default: every one.
    #[arg(long = "collection")]
    collections: Vec<String>,
    /// Shards exported at a time.
    #[arg(long, default_value_t = 4)]
    parallel: usize,
    /// Print the manifest as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct RestoreArgs {
    /// The backup directory.
    #[arg(long)]
    from: PathBuf,
    /// Replicas per shard of the restored collections; default: the backup's, at most the
    /// number of shard nodes up.
    #[arg(long)]
    replication: Option<u32>,
    /// Documents per RestoreDocuments call, [1, 256].
    #[arg(long, default_value_t = 128)]
    batch: usize,
    /// RestoreDocuments calls in flight.
    #[arg(long, default_value_t = 4)]
    parallel: usize,
}

#[derive(Serialize, Deserialize)]
struct Manifest {
    format: String,
    /// RFC 3339, when the backup began.
    created_at: String,
    took_ms: u64,
    collections: Vec<SavedCollection>,
    aliases: Vec<SavedAlias>,
}

#[derive(Serialize, Deserialize)]
struct SavedCollection {
    name: String,
    /// Its `CollectionInfo`, read after the shards (so the schema covers their fields).
    info: SavedFile,
    shards: Vec<SavedShard>,
}

#[derive(Serialize, Deserialize)]
struct SavedShard {
    shard: u32,
    /// The applied seq the shard's snapshot holds: the backup's token for the shard.
    seq: u64,
    documents: u64,
    chunks: u64,
    file: SavedFile,
}

#[derive(Serialize, Deserialize)]
struct SavedFile {
    /// Relative to the backup directory.
    path: String,
    bytes: u64,
    sha256: String,
}

#[derive(Serialize, Deserialize)]
struct SavedAlias {
    alias: String,
    collection: String,
}

pub async fn run(cli: &Cli, cmd: &BackupCmd) -> Result<()> {
    match cmd {
        BackupCmd::Create(a) => create(cli, a).await,
        BackupCmd::Restore(a) => restore(cli, a).await,
        BackupCmd::Verify { dir } => {
            let m = read_manifest(dir)?;
            let files = verify(dir, &m)?;
            println!("{}: {files} files match the manifest", dir.display());
            Ok(())
        }
    }
}

async fn clients(
    cli: &Cli,
) -> Result<(CoordinatorClient<KeyedChannel>, AdminClient<KeyedChannel>)> {
    let ch = channel(cli).await?;
    let c = CoordinatorClient::new(ch.clone())
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);
    let a = AdminClient::new(ch)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);
    Ok((c, a))
}

fn hex(d: impl AsRef<[u8]>) -> String {
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// `backup-YYYYMMDDTHHMMSSZ` for now.
fn stamp_name(now: SystemTime) -> String {
    let t = humantime::format_rfc3339_seconds(now).to_string();
    format!("backup-{}", t.replace(['-', ':'], ""))
}

async fn create(cli: &Cli, a: &CreateArgs) -> Result<()> {
    let started = Instant::now();
    let created_at = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    let dir = if a.stamp {
        a.to.join(stamp_name(SystemTime::now()))
    } else {
        a.to.clone()
    };
    if dir.exists() && std::fs::read_dir(&dir)?.next().is_some() {
        bail!(
            "{} is not empty: a backup goes into a new directory",
            dir.display()
        );
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let (mut c, admin) = clients(cli).await?;
    let names: Vec<String> = if a.collections.is_empty() {
        let r = c.list_collections(ListCollectionsRequest {}).await?;
        r.into_inner()
            .collections
            .into_iter()
            .map(|i| i.name)
            .collect()
    } else {
        let mut names = Vec::new();
        for n in &a.collections {
            names.push(describe(&mut c, n).await?.name);
        }
        names
    };
    let mut collections = Vec::new();
    for name in &names {
        let before = describe(&mut c, name).await?;
        std::fs::create_dir_all(dir.join(name))?;
        let shards: Vec<Result<SavedShard>> = futures::stream::iter(0..before.shard_count)
            .map(|s| save_shard(admin.clone(), &dir, name, s))
            .buffered(a.parallel.max(1))
            .collect()
            .await;
        let shards = shards.into_iter().collect::<Result<Vec<_>>>()?;
        // Read after the shards: fields added meanwhile are in the schema saved.
        let info = describe(&mut c, name).await?;
        let info = write_file(
            &dir,
            &format!("{name}/collection.pb"),
            &info.encode_to_vec(),
        )?;
        let (docs, chunks) = shards
            .iter()
            .fold((0, 0), |(d, c), s| (d + s.documents, c + s.chunks));
        eprintln!(
            "{name}: {docs} documents, {chunks} chunks in {} shards",
            shards.len()
        );
        collections.push(SavedCollection {
            name: name.clone(),
            info,
            shards,
        });
    }
    let aliases = c
        .list_aliases(ListAliasesRequest::default())
        .await?
        .into_inner()
        .aliases
        .into_iter()
        .filter(|al| names.contains(&al.collection))
        .map(|al| SavedAlias {
            alias: al.alias,
            collection: al.collection,
        })
        .collect();
    let manifest = Manifest {
        format: FORMAT.into(),
        created_at,
        took_ms: started.elapsed().as_millis() as u64,
        collections,
        aliases,
    };
    write_manifest(&dir, &manifest)?;
    report_created(&dir, &manifest, started.elapsed(), a.json);
    if let Some(keep) = a.keep {
        prune(&a.to, keep)?;
    }
    Ok(())
}

async fn describe(c: &mut CoordinatorClient<KeyedChannel>, name: &str) -> Result<CollectionInfo> {
    c.describe_collection(DescribeCollectionRequest { name: name.into() })
        .await
        .with_context(|| format!("describing {name}"))?
        .into_inner()
        .collection
        .context("DescribeCollection answered no collection")
}

/// Streams one shard's export into its file, hashing as it writes.
async fn save_shard(
    mut admin: AdminClient<KeyedChannel>,
    dir: &Path,
    collection: &str,
    shard: u32,
) -> Result<SavedShard> {
    let path = format!("{collection}/shard-{shard:04}.pb");
    let req = BackupShardRequest {
        collection: collection.into(),
        shard,
    };
    let mut parts = admin
        .backup_shard(req)
        .await
        .with_context(|| format!("backing up shard {shard} of {collection}"))?
        .into_inner();
    let file = File::create(dir.join(&path))?;
    let mut out = BufWriter::with_capacity(1 << 20, &file);
    let mut hash = Sha256::new();
    let (mut seq, mut documents, mut chunks, mut bytes, mut done) = (0, 0, 0, 0u64, false);
    while let Some(part) = parts
        .message()
        .await
        .with_context(|| format!("backing up shard {shard} of {collection}"))?
    {
        seq = part.seq;
        for d in &part.documents {
            let b = d.encode_length_delimited_to_vec();
            hash.update(&b);
            out.write_all(&b)?;
            bytes += b.len() as u64;
            documents += 1;
            chunks += d.chunks.len() as u64;
        }
        done |= part.done;
    }
    ensure!(
        done,
        "the export of shard {shard} of {collection} ended before its last document"
    );
    out.flush()?;
    drop(out);
    file.sync_all()?;
    Ok(SavedShard {
        shard,
        seq,
        documents,
        chunks,
        file: SavedFile {
            path,
            bytes,
            sha256: hex(hash.finalize()),
        },
    })
}

/// Writes `bytes` to `dir/rel`, durably, and describes it.
fn write_file(dir: &Path, rel: &str, bytes: &[u8]) -> Result<SavedFile> {
    let mut f = File::create(dir.join(rel))?;
    f.write_all(bytes)?;
    f.sync_all()?;
    Ok(SavedFile {
        path: rel.into(),
        bytes: bytes.len() as u64,
        sha256: hex(Sha256::digest(bytes)),
    })
}

/// The manifest last, renamed into place: only a complete backup has one.
fn write_manifest(dir: &Path, m: &Manifest) -> Result<()> {
    let tmp = dir.join("manifest.json.tmp");
    let mut f = File::create(&tmp)?;
    f.write_all(serde_json::to_string_pretty(m)?.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, dir.join(MANIFEST))?;
    File::open(dir)?.sync_all()?;
    Ok(())
}

fn report_created(dir: &Path, m: &Manifest, took: Duration, json: bool) {
    if json {
        println!("{}", serde_json::to_string(m).unwrap_or_default());
        return;
    }
    let chunks: u64 = m
        .collections
        .iter()
        .flat_map(|c| &c.shards)
        .map(|s| s.chunks)
        .sum();
    let bytes: u64 = m
        .collections
        .iter()
        .flat_map(|c| &c.shards)
        .map(|s| s.file.bytes)
        .sum();
    println!(
        "backup {}: {} collections, {} aliases, {chunks} chunks, {:.1} MiB in {:.1} s \
         ({:.0} chunks/s)",
        dir.display(),
        m.collections.len(),
        m.aliases.len(),
        bytes as f64 / f64::from(1 << 20),
        took.as_secs_f64(),
        chunks as f64 / took.as_secs_f64().max(1e-9)
    );
    for c in &m.collections {
        let token: Vec<String> = c
            .shards
            .iter()
            .map(|s| format!("{}@{}", s.shard, s.seq))
            .collect();
        println!("  {}: shard@seq {}", c.name, token.join(" "));
    }
}

/// Removes all but the newest `keep` complete stamped backups under `root`.
fn prune(root: &Path, keep: usize) -> Result<()> {
    let mut done: Vec<PathBuf> = std::fs::read_dir(root)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let stamped = p
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("backup-"));
            stamped && p.join(MANIFEST).exists()
        })
        .collect();
    done.sort();
    let old = done.len().saturating_sub(keep);
    for p in &done[..old] {
        std::fs::remove_dir_all(p).with_context(|| format!("removing {}", p.display()))?;
        eprintln!("removed the older backup {}", p.display());
    }
    Ok(())
}

fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "reading {} (a directory without a manifest is not a complete backup)",
            path.display()
        )
    })?;
    let m: Manifest =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    ensure!(
        m.format == FORMAT,
        "{} is a {:?} backup; this ragctl reads {FORMAT:?}",
        path.display(),
        m.format
    );
    Ok(m)
}

/// Checks every file of the manifest (size, then sha256); returns how many there are.
fn verify(dir: &Path, m: &Manifest) -> Result<usize> {
    let mut n = 0;
    for c in &m.collections {
        for f in std::iter::once(&c.info).chain(c.shards.iter().map(|s| &s.file)) {
            ensure!(
                !f.path.contains("..") && !f.path.starts_with('/'),
                "manifest path {:?} leaves the backup directory",
                f.path
            );
            let path = dir.join(&f.path);
            let file = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
            let size = file.metadata()?.len();
            ensure!(
                size == f.bytes,
                "{} is damaged: {size} bytes, the manifest says {}",
                path.display(),
                f.bytes
            );
            let mut r = BufReader::with_capacity(1 << 20, file);
            let mut hash = Sha256::new();
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let k = r.read(&mut buf)?;
                if k == 0 {
                    break;
                }
                hash.update(&buf[..k]);
            }
            let sum = hex(hash.finalize());
            ensure!(
                sum == f.sha256,
                "{} is damaged: sha256 {sum}, the manifest says {}",
                path.display(),
                f.sha256
            );
            n += 1;
        }
    }
    Ok(n)
}

/// The next length-delimited document of a shard file, None at its end.
fn next_document(r: &mut impl Read) -> Result<Option<DocumentWrite>> {
    let mut len: u64 = 0;
    for i in 0..10 {
        let mut b = [0u8; 1];
        if r.read(&mut b)? == 0 {
            ensure!(i == 0, "a shard file ends inside a length");
            return Ok(None);
        }
        len |= u64::from(b[0] & 0x7f) << (7 * i);
        if b[0] & 0x80 == 0 {
            break;
        }
    }
    ensure!(len <= MAX_MESSAGE as u64, "a document of {len} bytes");
    let mut buf = vec![0u8; len as usize];
    r.read_exact(&mut buf)?;
    Ok(Some(DocumentWrite::decode(buf.as_slice())?))
}

async fn restore(cli: &Cli, a: &RestoreArgs) -> Result<()> {
    let started = Instant::now();
    ensure!((1..=256).contains(&a.batch), "--batch must be in [1, 256]");
    let m = read_manifest(&a.from)?;
    let files = verify(&a.from, &m)?;
    eprintln!("{}: {files} files match the manifest", a.from.display());
    let mut infos = Vec::new();
    for c in &m.collections {
        let bytes = std::fs::read(a.from.join(&c.info.path))?;
        infos.push(CollectionInfo::decode(bytes.as_slice())?);
    }
    let (mut c, mut admin) = clients(cli).await?;
    // Nothing is created unless every name is free.
    let have = c
        .list_collections(ListCollectionsRequest {})
        .await?
        .into_inner();
    let aliases = c
        .list_aliases(ListAliasesRequest::default())
        .await?
        .into_inner()
        .aliases;
    for name in infos
        .iter()
        .map(|i| &i.name)
        .chain(m.aliases.iter().map(|al| &al.alias))
    {
        let taken = have.collections.iter().any(|h| &h.name == name)
            || aliases.iter().any(|al| &al.alias == name);
        ensure!(
            !taken,
            "the cluster already has {name:?}: a restore needs a cluster without the backup's \
             collections and aliases (drop them, or restore into another cluster)"
        );
    }
    let nodes = shard_nodes_up(&mut admin).await?;
    let mut chunks = 0u64;
    for (saved, info) in m.collections.iter().zip(&infos) {
        let rf = a
            .replication
            .unwrap_or(info.replication_factor)
            .min(nodes)
            .max(1);
        let created = c
            .create_collection(CreateCollectionRequest {
                name: info.name.clone(),
                shard_count: info.shard_count,
                replication_factor: rf,
                chunking: info.chunking,
                embedding_model: info.embedding_model.clone(),
                hnsw: info.hnsw,
                fields: info.fields.clone(),
            })
            .await
            .with_context(|| format!("creating {}", info.name))?
            .into_inner()
            .collection
            .unwrap_or_default();
        if created.dimension != info.dimension {
            let _ = (c.drop_collection(DropCollectionRequest {
                name: info.name.clone(),
            }))
            .await;
            bail!(
                "{}: the model {:?} here gives {}-d vectors, the backup holds {}-d ones",
                info.name,
                info.embedding_model,
                created.dimension,
                info.dimension
            );
        }
        for s in &saved.shards {
            chunks += restore_shard(&admin, &a.from, &info.name, s, a).await?;
        }
        eprintln!("{}: restored with {rf} replicas per shard", info.name);
    }
    for group in m.aliases.chunks(64) {
        let actions = group
            .iter()
            .map(|al| AliasAction {
                action: Some(alias_action::Action::Put(Alias {
                    alias: al.alias.clone(),
                    collection: al.collection.clone(),
                })),
            })
            .collect();
        c.update_aliases(UpdateAliasesRequest { actions }).await?;
    }
    let took = started.elapsed().as_secs_f64();
    println!(
        "restored {} collections, {} aliases, {chunks} chunks from {} in {took:.1} s \
         ({:.0} chunks/s)",
        m.collections.len(),
        m.aliases.len(),
        a.from.display(),
        chunks as f64 / took.max(1e-9)
    );
    Ok(())
}

async fn shard_nodes_up(admin: &mut AdminClient<KeyedChannel>) -> Result<u32> {
    let st = admin
        .cluster_status(ClusterStatusRequest {})
        .await?
        .into_inner();
    let up = st
        .nodes
        .iter()
        .filter(|n| n.kind() == NodeKind::ShardNode && n.state() == MemberState::Up)
        .count() as u32;
    Ok(up.max(1))
}

/// Writes one shard file back, `a.parallel` calls in flight; returns its chunks.
async fn restore_shard(
    admin: &AdminClient<KeyedChannel>,
    dir: &Path,
    collection: &str,
    s: &SavedShard,
    a: &RestoreArgs,
) -> Result<u64> {
    let mut r = BufReader::with_capacity(1 << 20, File::open(dir.join(&s.file.path))?);
    let mut batches = Vec::new();
    let (mut batch, mut bytes, mut chunks) = (Vec::new(), 0, 0u64);
    while let Some(d) = next_document(&mut r)? {
        let size = d.encoded_len();
        if !batch.is_empty() && (batch.len() >= a.batch || bytes + size > RESTORE_CALL_BYTES) {
            batches.push(std::mem::take(&mut batch));
            bytes = 0;
        }
        chunks += d.chunks.len() as u64;
        bytes += size;
        batch.push(d);
    }
    if !batch.is_empty() {
        batches.push(batch);
    }
    let calls: Vec<Result<()>> = futures::stream::iter(batches)
        .map(|documents| restore_call(admin.clone(), collection, documents))
        .buffer_unordered(a.parallel.max(1))
        .collect()
        .await;
    calls.into_iter().collect::<Result<Vec<()>>>()?;
    ensure!(
        chunks == s.chunks,
        "{}: {chunks} chunks read, the manifest says {}",
        s.file.path,
        s.chunks
    );
    Ok(chunks)
}

/// One RestoreDocuments call, asked again while the cluster answers UNAVAILABLE (a restore
/// replaces documents whole, so a repeat is harmless).
async fn restore_call(
    mut admin: AdminClient<KeyedChannel>,
    collection: &str,
    documents: Vec<DocumentWrite>,
) -> Result<()> {
    let (mut wait, mut attempts) = (Duration::from_millis(200), 0);
    loop {
        let req = RestoreDocumentsRequest {
            collection: collection.into(),
            documents: documents.clone(),
        };
        match admin.restore_documents(req).await {
            Ok(_) => return Ok(()),
            Err(s) if s.code() == tonic::Code::Unavailable && attempts < 10 => {
                attempts += 1;
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(5));
            }
            Err(s) => {
                return Err(anyhow::anyhow!(
                    "restoring documents of {collection}: {}: {}",
                    s.code(),
                    s.message()
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_files_read_back_document_by_document() {
        let docs: Vec<DocumentWrite> = (0..3)
            .map(|i| DocumentWrite {
                doc_id: format!("d{i}"),
                chunks: vec![Chunk {
                    chunk_id: format!("d{i}#0"),
                    text: "x".repeat(200 * i),
                    embedding: vec![0.5; 384],
                    ..Default::default()
                }],
                delete: false,
            })
            .collect();
        let bytes: Vec<u8> = docs
            .iter()
            .flat_map(|d| d.encode_length_delimited_to_vec())
            .collect();
        let mut r = bytes.as_slice();
        for d in &docs {
            assert_eq!(next_document(&mut r).unwrap().as_ref(), Some(d));
        }
        assert!(next_document(&mut r).unwrap().is_none());
        let cut = &bytes[..bytes.len() - 3];
        let mut r = cut;
        next_document(&mut r).unwrap();
        next_document(&mut r).unwrap();
        assert!(
            next_document(&mut r).is_err(),
            "a truncated file is an error"
        );
    }

    #[test]
    fn stamped_directories_sort_by_time() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_450_000);
        let a = stamp_name(t);
        let b = stamp_name(t + Duration::from_secs(61));
        assert!(a.starts_with("backup-20") && a.ends_with('Z') && !a.contains(':'));
        assert!(a < b);
    }
}
