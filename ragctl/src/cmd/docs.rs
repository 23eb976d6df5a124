//! Search and collections: `ragctl search`, `collection ...`.

use anyhow::{Context, Result};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;

use crate::cmd::status::print_shards;
use crate::{Cli, CollectionCmd, Mode, channel};

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
    if let CollectionCmd::Reembed(a) = cmd {
        return crate::cmd::reembed::run(cli, a).await;
    }
    let mut c = CoordinatorClient::new(channel(cli).await?);
    match cmd {
        CollectionCmd::Create {
            name,
            shards,
            replication_factor,
            chunking,
            chunk_size,
            chunk_overlap,
            embedding_model,
        } => {
            let strategy = chunking.strategy();
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
                    embedding_model: embedding_model.clone(),
                    ..Default::default()
                })
                .await?;
            let c = r.into_inner().collection.unwrap_or_default();
            println!(
                "created collection {} ({} shards, replication factor {}, {} chunking, \
                 {}, dimension {})",
                c.name,
                c.shard_count,
                c.replication_factor,
                chunking.name(),
                c.embedding_model,
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
        CollectionCmd::Reembed(_) => {}
    }
    Ok(())
}

/// `ragctl search`.
#[derive(clap::Args, Debug)]
pub struct SearchArgs {
    /// The query text.
    query: String,
    /// Collection to search.
    #[arg(long, default_value = "docs")]
    pub collection: String,
    /// Retriever: BM25, dense vectors, or both fused.
    #[arg(long, value_enum, default_value_t = Mode::Hybrid)]
    mode: Mode,
    /// Hits to return.
    #[arg(long, default_value_t = 5)]
    top_k: u32,
    /// rrf, cc or dbsf.
    #[arg(long, default_value = "dbsf")]
    fusion: String,
    /// Weight of the dense retriever in [0, 1] for cc/dbsf fusion.
    #[arg(long)]
    dense_weight: Option<f32>,
    /// Exact metadata filter key=value (repeatable).
    #[arg(long = "filter")]
    filters: Vec<String>,
    /// Typed filter expression, e.g. 'lang = en AND year >= 2020' (see `ragctl count
    /// --help`).
    #[arg(long = "where")]
    pub where_: Option<String>,
    /// Score every chunk's vector instead of walking the HNSW graph (dense and hybrid): the
    /// exact dense top, at a cost linear in the collection.
    #[arg(long)]
    exact: bool,
    /// Hits as ids, positions and scores only: no chunk text or metadata is read or sent.
    #[arg(long)]
    ids_only: bool,
    /// A write's read token (UpsertDocumentsResponse.read_token): the search sees that
    /// write, read from replicas that applied it.
    #[arg(long)]
    read_token: Option<String>,
    /// Print the hits as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn search(cli: &Cli, a: &SearchArgs, conditions: Option<Filter>) -> Result<()> {
    let mut filter = std::collections::HashMap::new();
    for f in &a.filters {
        let (k, v) = f.split_once('=').context("--filter takes key=value")?;
        filter.insert(k.to_owned(), v.to_owned());
    }
    let req = SearchRequest {
        collection: a.collection.clone(),
        query: a.query.clone(),
        top_k: a.top_k,
        mode: match a.mode {
            Mode::Bm25 => SearchMode::Bm25,
            Mode::Dense => SearchMode::Dense,
            Mode::Hybrid => SearchMode::Hybrid,
        } as i32,
        fusion: a.fusion.clone(),
        dense_weight: a.dense_weight,
        filter,
        conditions,
        read_token: a.read_token.clone().unwrap_or_default(),
        exact: a.exact,
        ids_only: a.ids_only,
        ..Default::default()
    };
    let resp = CoordinatorClient::new(channel(cli).await?)
        .search(req)
        .await?
        .into_inner();
    if a.json {
        print_hits_json(&resp);
    } else {
        print_hits(&resp);
    }
    Ok(())
}
