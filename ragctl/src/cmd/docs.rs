//! Documents and collections: `ragctl ingest`, `search`, `collection ...`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use indicatif::{ProgressBar, ProgressStyle};
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;

use crate::cmd::status::print_shards;
use crate::{Chunker, Cli, CollectionCmd, Mode, channel};

fn collect_files(p: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    if p.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(p)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        for e in entries {
            collect_files(&e, out)?;
        }
    } else if matches!(
        p.extension().and_then(|e| e.to_str()),
        Some("md" | "markdown" | "txt")
    ) {
        out.push(p.to_path_buf());
    }
    Ok(())
}

/// Title of a file: its first Markdown heading, else the file name.
fn title_of(path: &Path, text: &str) -> String {
    text.lines()
        .find_map(|l| l.strip_prefix("# ").map(|t| t.trim().to_owned()))
        .unwrap_or_else(|| {
            path.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        })
}

pub async fn ingest(cli: &Cli, paths: &[PathBuf], collection: &str, batch: usize) -> Result<()> {
    let mut files = Vec::new();
    for p in paths {
        collect_files(p, &mut files)?;
    }
    if files.is_empty() {
        bail!("no .md/.txt files under the given paths");
    }
    let mut client = CoordinatorClient::new(channel(cli).await?);
    let exists = client
        .list_collections(ListCollectionsRequest {})
        .await?
        .into_inner()
        .collections
        .iter()
        .any(|c| c.name == collection);
    if !exists {
        client
            .create_collection(CreateCollectionRequest {
                name: collection.to_owned(),
                chunking: Some(ChunkingConfig {
                    strategy: ChunkingStrategy::Markdown as i32,
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await?;
        println!("created collection {collection} (markdown chunking, 3 shards)");
    }
    let bar = ProgressBar::new(files.len() as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} docs {msg} [{elapsed}]",
    )?);
    let (mut docs_n, mut chunks_n) = (0, 0);
    for group in files.chunks(batch.max(1)) {
        let mut documents = Vec::new();
        for f in group {
            let text = std::fs::read_to_string(f).with_context(|| f.display().to_string())?;
            let mut metadata = std::collections::HashMap::new();
            metadata.insert("path".to_string(), f.display().to_string());
            documents.push(Document {
                id: f.display().to_string(),
                title: title_of(f, &text),
                text,
                metadata,
                embedding: vec![],
            });
        }
        let r = client
            .upsert_documents(UpsertDocumentsRequest {
                collection: collection.to_owned(),
                documents,
            })
            .await?
            .into_inner();
        docs_n += r.documents;
        chunks_n += r.chunks;
        bar.inc(group.len() as u64);
        bar.set_message(format!("{chunks_n} chunks"));
    }
    bar.finish();
    println!("ingested {docs_n} documents as {chunks_n} chunks into {collection}");
    Ok(())
}

fn snippet(s: &str, n: usize) -> String {
    let flat: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() > n {
        format!("{}…", flat.chars().take(n).collect::<String>())
    } else {
        flat
    }
}

fn rank(r: &Option<RetrieverScore>) -> String {
    r.as_ref()
        .map(|r| format!("#{} ({:.3})", r.rank, r.score))
        .unwrap_or_else(|| "-".into())
}

fn print_hits(r: &SearchResponse) {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED)
        .set_header(["#", "score", "document", "section", "bm25", "dense", "text"]);
    for (i, h) in r.hits.iter().enumerate() {
        t.add_row([
            (i + 1).to_string(),
            format!("{:.4}", h.score),
            snippet(&h.title, 30),
            snippet(&h.section, 30),
            rank(&h.bm25),
            rank(&h.dense),
            snippet(&h.text, 90),
        ]);
    }
    println!("{t}");
    println!(
        "{} hits in {:.1} ms from {}/{} shards",
        r.hits.len(),
        r.took_us as f64 / 1000.0,
        r.shards_ok,
        r.shards_total
    );
}

fn print_hits_json(r: &SearchResponse) {
    let hits: Vec<serde_json::Value> = r
        .hits
        .iter()
        .map(|h| {
            serde_json::json!({
                "chunk_id": h.chunk_id, "doc_id": h.doc_id, "title": h.title, "section": h.section,
                "score": h.score, "bm25": h.bm25.as_ref().map(|x| (x.rank, x.score)),
                "dense": h.dense.as_ref().map(|x| (x.rank, x.score)), "text": h.text,
            })
        })
        .collect();
    println!(
        "{}",
        serde_json::json!({ "hits": hits, "took_us": r.took_us })
    );
}

pub async fn collection(cli: &Cli, cmd: &CollectionCmd) -> Result<()> {
    let mut c = CoordinatorClient::new(channel(cli).await?);
    match cmd {
        CollectionCmd::Create {
            name,
            shards,
            replication_factor,
            chunking,
            chunk_size,
            chunk_overlap,
        } => {
            let strategy = match chunking {
                Chunker::Fixed => ChunkingStrategy::Fixed,
                Chunker::Sentence => ChunkingStrategy::Sentence,
                Chunker::Markdown => ChunkingStrategy::Markdown,
            };
            let r = c
                .create_collection(CreateCollectionRequest {
                    name: name.clone(),
                    shard_count: *shards,
                    replication_factor: *replication_factor,
                    chunking: Some(ChunkingConfig {
                        strategy: strategy as i32,
                        chunk_size: *chunk_size,
                        chunk_overlap: *chunk_overlap,
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .await?;
            let c = r.into_inner().collection.unwrap_or_default();
            println!(
                "created collection {} ({} shards, replication factor {}, {} chunking, \
                 dimension {})",
                c.name,
                c.shard_count,
                c.replication_factor,
                chunking.name(),
                c.dimension
            );
        }
        CollectionCmd::Drop { name } => {
            c.drop_collection(DropCollectionRequest { name: name.clone() })
                .await?;
            println!("dropped {name}");
        }
        CollectionCmd::List => {
            let mut t = Table::new();
            t.load_preset(UTF8_FULL_CONDENSED)
                .set_header(["name", "shards", "model", "dim"]);
            for col in c
                .list_collections(ListCollectionsRequest {})
                .await?
                .into_inner()
                .collections
            {
                t.add_row([
                    col.name,
                    col.shard_count.to_string(),
                    col.embedding_model,
                    col.dimension.to_string(),
                ]);
            }
            println!("{t}");
        }
        CollectionCmd::Describe { name } => {
            let d = c
                .describe_collection(DescribeCollectionRequest { name: name.clone() })
                .await?
                .into_inner();
            print_shards(&d.shards);
        }
    }
    Ok(())
}

/// `ragctl search`.
#[allow(clippy::too_many_arguments)]
pub async fn search(
    cli: &Cli,
    query: &str,
    collection: &str,
    mode: Mode,
    top_k: u32,
    fusion: &str,
    dense_weight: Option<f32>,
    filters: &[String],
    json: bool,
) -> Result<()> {
    let mut filter = std::collections::HashMap::new();
    for f in filters {
        let (k, v) = f.split_once('=').context("--filter takes key=value")?;
        filter.insert(k.to_owned(), v.to_owned());
    }
    let req = SearchRequest {
        collection: collection.to_owned(),
        query: query.to_owned(),
        top_k,
        mode: match mode {
            Mode::Bm25 => SearchMode::Bm25,
            Mode::Dense => SearchMode::Dense,
            Mode::Hybrid => SearchMode::Hybrid,
        } as i32,
        fusion: fusion.to_owned(),
        dense_weight,
        filter,
        ..Default::default()
    };
    let resp = CoordinatorClient::new(channel(cli).await?)
        .search(req)
        .await?
        .into_inner();
    if json {
        print_hits_json(&resp);
    } else {
        print_hits(&resp);
    }
    Ok(())
}
