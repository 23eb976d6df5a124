//! Reading stored data back: `ragctl get`, `ragctl scroll` (pages through a collection, or
//! exports all of it as JSON lines) and `ragctl count`.

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;

use anyhow::{Context, Result};
use ragcluster_common::client::KeyedChannel;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;

use crate::{Cli, channel};

/// `key=value` pairs as a filter.
pub fn filter(pairs: &[String]) -> Result<HashMap<String, String>> {
    pairs
        .iter()
        .map(|f| {
            let (k, v) = f.split_once('=').context("--filter takes key=value")?;
            Ok((k.to_owned(), v.to_owned()))
        })
        .collect()
}

/// `--where EXPR` as a typed filter, its values read by the collection's schema.
pub async fn conditions(cli: &Cli, collection: &str, expr: Option<&str>) -> Result<Option<Filter>> {
    let Some(expr) = expr else {
        return Ok(None);
    };
    let info = client(cli)
        .await?
        .describe_collection(DescribeCollectionRequest {
            name: collection.to_owned(),
        })
        .await?
        .into_inner()
        .collection
        .unwrap_or_default();
    let mut schema: BTreeMap<String, FieldType> = info
        .fields
        .iter()
        .map(|f| (f.name.clone(), f.r#type()))
        .collect();
    schema.entry("section".into()).or_insert(FieldType::Keyword);
    Ok(Some(ragctl::filter::parse(expr, &schema)?))
}

/// A typed value as JSON (datetimes as RFC 3339).
pub fn value_json(v: &Value) -> serde_json::Value {
    use value::Kind;
    match &v.kind {
        Some(Kind::Keyword(s)) => serde_json::json!(s),
        Some(Kind::Integer(i)) => serde_json::json!(i),
        Some(Kind::Float(f)) => serde_json::json!(f),
        Some(Kind::Boolean(b)) => serde_json::json!(b),
        Some(Kind::DatetimeUs(us)) => {
            let t = std::time::UNIX_EPOCH
                .checked_add(std::time::Duration::from_micros(us.unsigned_abs()))
                .filter(|_| *us >= 0);
            match t {
                Some(t) => serde_json::json!(humantime::format_rfc3339_micros(t).to_string()),
                None => serde_json::json!(us),
            }
        }
        Some(Kind::Keywords(k)) => serde_json::json!(k.values),
        None => serde_json::Value::Null,
    }
}

fn fields_json(fields: &HashMap<String, Value>) -> serde_json::Value {
    let m: serde_json::Map<String, serde_json::Value> = fields
        .iter()
        .map(|(k, v)| (k.clone(), value_json(v)))
        .collect();
    serde_json::Value::Object(m)
}

fn chunk_json(c: &Chunk) -> serde_json::Value {
    let mut v = serde_json::json!({
        "chunk_id": c.chunk_id, "doc_id": c.doc_id, "position": c.position, "title": c.title,
        "section": c.section, "metadata": c.metadata, "text": c.text,
    });
    if !c.fields.is_empty() {
        v["fields"] = fields_json(&c.fields);
    }
    if !c.embedding.is_empty() {
        v["embedding"] = serde_json::json!(c.embedding);
    }
    v
}

async fn client(cli: &Cli) -> Result<CoordinatorClient<KeyedChannel>> {
    Ok(CoordinatorClient::new(channel(cli).await?).max_decoding_message_size(64 << 20))
}

/// `ragctl get`.
#[derive(clap::Args, Debug)]
pub struct GetArgs {
    /// Document ids (at most 256).
    #[arg(required = true)]
    ids: Vec<String>,
    /// The collection (or an alias of it).
    #[arg(long, default_value = "docs")]
    collection: String,
    /// Also print each chunk's embedding.
    #[arg(long)]
    with_embedding: bool,
    /// A write's read token: read from replicas that applied it.
    #[arg(long, default_value = "")]
    read_token: String,
}

/// `ragctl get`: one JSON object per document found; the ids not found on stderr.
pub async fn get(cli: &Cli, a: &GetArgs) -> Result<()> {
    let r = client(cli)
        .await?
        .get_documents(GetDocumentsRequest {
            collection: a.collection.clone(),
            ids: a.ids.clone(),
            with_embedding: a.with_embedding,
            read_token: a.read_token.clone(),
            ..Default::default()
        })
        .await?
        .into_inner();
    for d in &r.documents {
        let chunks: Vec<_> = d.chunks.iter().map(chunk_json).collect();
        println!(
            "{}",
            serde_json::json!({
                "id": d.id, "title": d.title, "metadata": d.metadata,
                "fields": fields_json(&d.fields), "chunks": chunks,
            })
        );
    }
    if !r.not_found.is_empty() {
        eprintln!("not found: {}", r.not_found.join(", "));
    }
    Ok(())
}

/// `ragctl scroll`.
#[derive(clap::Args, Debug)]
pub struct ScrollArgs {
    /// The collection (or an alias of it).
    #[arg(long, default_value = "docs")]
    collection: String,
    /// Exact metadata filter key=value (repeatable).
    #[arg(long = "filter")]
    filters: Vec<String>,
    /// Typed filter expression, e.g. 'lang = en AND year >= 2020 AND tags IN [a, b]'
    /// (AND, OR, NOT, parentheses, = != < <= > >=, IN [..], exists(field); values read by
    /// their field's type in the collection's schema).
    #[arg(long = "where")]
    where_: Option<String>,
    /// Chunks per page, [1, 1000].
    #[arg(long, default_value_t = 1000)]
    limit: u32,
    /// Continue from a page's cursor.
    #[arg(long, default_value = "")]
    cursor: String,
    /// Read every page to the end.
    #[arg(long)]
    all: bool,
    /// Also print each chunk's embedding.
    #[arg(long)]
    with_embedding: bool,
    /// A write's read token: read from replicas that applied it.
    #[arg(long, default_value = "")]
    read_token: String,
}

/// `ragctl scroll`: one JSON line per chunk; one page (its cursor on stderr) or, with
/// `--all`, every page, with the pace on stderr at the end.
pub async fn scroll(cli: &Cli, a: &ScrollArgs) -> Result<()> {
    let mut c = client(cli).await?;
    let started = std::time::Instant::now();
    let mut cursor = a.cursor.clone();
    let filter = filter(&a.filters)?;
    let conditions = conditions(cli, &a.collection, a.where_.as_deref()).await?;
    let mut n = 0u64;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    loop {
        let page = c
            .scroll(ScrollRequest {
                collection: a.collection.clone(),
                filter: filter.clone(),
                conditions: conditions.clone(),
                limit: a.limit,
                cursor: cursor.clone(),
                with_embedding: a.with_embedding,
                read_token: a.read_token.clone(),
                ..Default::default()
            })
            .await?
            .into_inner();
        for ch in &page.chunks {
            writeln!(out, "{}", chunk_json(ch))?;
        }
        n += page.chunks.len() as u64;
        cursor = page.next_cursor;
        if !a.all || cursor.is_empty() {
            break;
        }
    }
    out.flush()?;
    let secs = started.elapsed().as_secs_f64();
    if a.all {
        eprintln!(
            "{n} chunks in {secs:.2} s ({:.0} chunks/s)",
            n as f64 / secs.max(1e-9)
        );
    } else if !cursor.is_empty() {
        eprintln!("next cursor: {cursor}");
    }
    Ok(())
}

/// `ragctl count`.
#[derive(clap::Args, Debug)]
pub struct CountArgs {
    /// The collection (or an alias of it).
    #[arg(long, default_value = "docs")]
    collection: String,
    /// Exact metadata filter key=value (repeatable).
    #[arg(long = "filter")]
    filters: Vec<String>,
    /// Typed filter expression, e.g. 'lang = en AND year >= 2020 AND tags IN [a, b]'
    /// (AND, OR, NOT, parentheses, = != < <= > >=, IN [..], exists(field); values read by
    /// their field's type in the collection's schema).
    #[arg(long = "where")]
    where_: Option<String>,
    /// A write's read token: count on replicas that applied it.
    #[arg(long, default_value = "")]
    read_token: String,
    /// Print {"chunks": N, "documents": M}.
    #[arg(long)]
    json: bool,
}

/// `ragctl count`.
pub async fn count(cli: &Cli, a: &CountArgs) -> Result<()> {
    let r = client(cli)
        .await?
        .count(CountRequest {
            collection: a.collection.clone(),
            filter: filter(&a.filters)?,
            conditions: conditions(cli, &a.collection, a.where_.as_deref()).await?,
            read_token: a.read_token.clone(),
            ..Default::default()
        })
        .await?
        .into_inner();
    if a.json {
        println!(
            "{}",
            serde_json::json!({ "chunks": r.chunks, "documents": r.documents })
        );
    } else {
        println!("{} chunks in {} documents", r.chunks, r.documents);
    }
    Ok(())
}
