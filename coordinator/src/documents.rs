//! Reading stored data back, as Qdrant's retrieve / scroll / count and Elasticsearch's
//! mget / search_after / _count: documents by id, every chunk of a collection page by page in
//! (document id, position) order, and exact counts by filter. Each is validated whole before
//! any shard is asked, and reads under the same consistency and read-token rules as Search.
//!
//! A Scroll page asks every shard for up to `limit` chunks after the cursor and merges them:
//! only chunks up to the smallest last key of the shards that stopped early are known to be
//! complete, so the page ends there (as Elasticsearch's search_after over shards). The cursor
//! (`sc1.` + base64url of `ScrollCursorBody`) holds where the page ended, a fingerprint of
//! the filter, and a read token raised to each shard's seq of every page, so a later page is
//! never read from an older state than an earlier one.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use futures::future::join_all;
use prost::Message as _;
use ragcluster_proto::v1::*;
use sha2::Digest as _;

use crate::catalog::Catalog;
use crate::error::{CoordError, Result};
use crate::ingest::{check_collection, check_id};
use crate::limits::{
    DEFAULT_SCROLL_LIMIT, MAX_CURSOR_BYTES, MAX_DOCS_PER_BATCH, MAX_SCROLL_LIMIT,
    MAX_SCROLL_PAGE_BYTES, MAX_SEARCH_TIMEOUT_MS,
};
use crate::placement;
use crate::read_token::ReadToken;
use crate::shards::{ReadPlan, Shards};

const CURSOR_PREFIX: &str = "sc1.";

pub struct Documents {
    catalog: Arc<Catalog>,
    shards: Arc<Shards>,
    /// Deadline of a call that gives none (`coordinator.search_timeout`).
    default_timeout: Duration,
    /// Ids per GetDocuments (`limits.max_batch_documents`).
    max_batch: usize,
}

/// What every call shares: the collection, its token, consistency and deadline.
struct Read {
    info: CollectionInfo,
    token: ReadToken,
    consistency: Consistency,
    deadline: Instant,
}

impl Read {
    fn plan(&self) -> ReadPlan<'_> {
        ReadPlan {
            collection: &self.info.name,
            replicas: &self.info.shards,
            consistency: self.consistency,
            deadline: self.deadline,
            token: &self.token,
        }
    }
}

fn consistency(v: i32) -> Result<Consistency> {
    match Consistency::try_from(v) {
        Ok(Consistency::Strong) => Ok(Consistency::Strong),
        Ok(Consistency::Eventual | Consistency::Unspecified) => Ok(Consistency::Eventual),
        Err(_) => Err(CoordError::invalid(
            "consistency",
            format!("unknown value {v}"),
        )),
    }
}

/// The exact-match map (no empty key) and the typed filter (against the schema).
fn check_filter(
    filter: &HashMap<String, String>,
    conditions: Option<&Filter>,
    info: &CollectionInfo,
) -> Result<()> {
    if filter.keys().any(String::is_empty) {
        return Err(CoordError::invalid("filter", "has an empty key"));
    }
    match conditions {
        Some(f) => crate::schema::check_filter("conditions", f, info),
        None => Ok(()),
    }
}

/// A chunk's place in scroll order.
fn key(c: &Chunk) -> (&str, u32) {
    (c.doc_id.as_str(), c.position)
}

/// Fingerprint of what a scroll returns besides its position: its filter and whether it
/// carries embeddings (a cursor is only valid for the same).
fn query_hash(
    filter: &HashMap<String, String>,
    conditions: Option<&Filter>,
    with_embedding: bool,
) -> u64 {
    let mut pairs: Vec<_> = filter.iter().collect();
    pairs.sort();
    let mut h = sha2::Sha256::new();
    for (k, v) in pairs {
        h.update((k.len() as u64).to_le_bytes());
        h.update(k.as_bytes());
        h.update((v.len() as u64).to_le_bytes());
        h.update(v.as_bytes());
    }
    h.update([u8::from(with_embedding)]);
    // prost encodes a Filter (no maps inside) the same way every time.
    if let Some(c) = conditions {
        h.update(c.encode_to_vec());
    }
    u64::from_le_bytes(h.finalize()[..8].try_into().unwrap_or_default())
}

/// A cursor's contents, if it is one.
fn cursor_body(cursor: &str) -> Option<ScrollCursorBody> {
    let bytes = URL_SAFE_NO_PAD
        .decode(cursor.strip_prefix(CURSOR_PREFIX)?)
        .ok()?;
    ScrollCursorBody::decode(bytes.as_slice()).ok()
}

/// A cursor's position and token, checked against the request it comes back with (which
/// `named` the collection `info`, or an alias of it).
fn parse_cursor(
    r: &ScrollRequest,
    info: &CollectionInfo,
    named: &str,
) -> Result<Option<(String, u32, ReadToken)>> {
    if r.cursor.is_empty() {
        return Ok(None);
    }
    if r.cursor.len() > MAX_CURSOR_BYTES {
        return Err(CoordError::invalid(
            "cursor",
            format!(
                "{} bytes; a cursor has at most {MAX_CURSOR_BYTES}",
                r.cursor.len()
            ),
        ));
    }
    let bad = || {
        CoordError::invalid(
            "cursor",
            "not a scroll cursor; pass a page's next_cursor as it is",
        )
    };
    let c = cursor_body(&r.cursor).ok_or_else(bad)?;
    if c.query_hash != query_hash(&r.filter, r.conditions.as_ref(), r.with_embedding) {
        return Err(CoordError::invalid(
            "cursor",
            "was made for another filter or with_embedding; a scroll keeps the ones it \
             started with",
        ));
    }
    let token = ReadToken::from_body("cursor", c.token.unwrap_or_default(), info, named)?;
    Ok(Some((c.after_doc_id, c.after_position, token)))
}

fn encode_cursor(last: &Chunk, token: &ReadToken, info: &CollectionInfo, hash: u64) -> String {
    let body = ScrollCursorBody {
        after_doc_id: last.doc_id.clone(),
        after_position: last.position,
        token: Some(token.body(info)),
        query_hash: hash,
    };
    format!(
        "{CURSOR_PREFIX}{}",
        URL_SAFE_NO_PAD.encode(body.encode_to_vec())
    )
}

/// Chunks asked of each shard for a page of `limit`: documents spread evenly over shards by
/// their id's hash, so each shard's share of a page plus a quarter (and a few) usually fills
/// it, where asking every shard for the whole page would read and send `shards` times the
/// chunks kept. A page cut short by a shard that stopped early is still correct (its cursor
/// goes on from where it ended), just smaller.
fn per_shard(limit: u32, shards: usize) -> u32 {
    let shards = shards.max(1) as u32;
    if shards == 1 {
        return limit;
    }
    (limit.div_ceil(shards) * 5 / 4 + 8).min(limit)
}

/// The page of merged shard answers: every shard's chunks up to the point all of them are
/// complete, in scroll order, cut at `limit` and the byte cap (at least one chunk). Also
/// whether chunks remain after it.
fn merge_page(answers: Vec<ScanResponse>, limit: usize) -> (Vec<Chunk>, bool) {
    // A shard that stopped early (not done) has sent at least one chunk; past its last one
    // it may hold more that sort before another shard's chunks.
    let bound: Option<(String, u32)> = answers
        .iter()
        .filter(|a| !a.done)
        .filter_map(|a| a.chunks.last())
        .map(|c| (c.doc_id.clone(), c.position))
        .min();
    let mut all: Vec<Chunk> = answers.into_iter().flat_map(|a| a.chunks).collect();
    all.sort_by(|a, b| key(a).cmp(&key(b)));
    if let Some((doc, pos)) = &bound {
        all.retain(|c| key(c) <= (doc.as_str(), *pos));
    }
    let mut more = bound.is_some();
    let mut bytes = 0usize;
    let mut n = 0;
    for c in &all {
        let size = c.encoded_len();
        if n == limit || (n > 0 && bytes + size > MAX_SCROLL_PAGE_BYTES) {
            more = true;
            break;
        }
        bytes += size;
        n += 1;
    }
    all.truncate(n);
    (all, more)
}

/// A stored document from its chunks (in position order).
fn stored(id: String, chunks: Vec<Chunk>) -> StoredDocument {
    let (title, metadata, fields) = chunks.first().map_or_else(Default::default, |c| {
        let mut m = c.metadata.clone();
        if !c.section.is_empty() {
            m.remove("section");
        }
        (c.title.clone(), m, c.fields.clone())
    });
    StoredDocument {
        id,
        title,
        metadata,
        chunks,
        fields,
    }
}

impl Documents {
    pub fn new(
        catalog: Arc<Catalog>,
        shards: Arc<Shards>,
        default_timeout: Duration,
        max_batch: usize,
    ) -> Self {
        Self {
            catalog,
            shards,
            default_timeout,
            max_batch,
        }
    }

    /// The checks every call shares, and its deadline: a read of `collection`, which the
    /// request `named` (the same, or an alias).
    fn read(
        &self,
        (collection, named): (&str, &str),
        read_token: &str,
        consistency_value: i32,
        timeout_ms: u32,
    ) -> Result<Read> {
        check_collection("collection", named)?;
        if timeout_ms > MAX_SEARCH_TIMEOUT_MS {
            return Err(CoordError::invalid(
                "timeout_ms",
                format!("{timeout_ms} is above the limit of {MAX_SEARCH_TIMEOUT_MS}"),
            ));
        }
        let info = self.catalog.get(collection)?;
        let token = ReadToken::parse("read_token", read_token, &info, named)?;
        let timeout = match timeout_ms {
            0 => self.default_timeout,
            ms => Duration::from_millis(u64::from(ms)),
        };
        Ok(Read {
            info,
            token,
            consistency: consistency(consistency_value)?,
            deadline: Instant::now() + timeout,
        })
    }

    /// Runs `f` under the read's deadline: one cut short is DEADLINE_EXCEEDED.
    async fn timed<T>(
        what: &str,
        deadline: Instant,
        f: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, f).await {
            Err(_) => Err(CoordError::Deadline(what.into())),
            Ok(Err(e)) if e.is_retryable() && Instant::now() >= deadline => {
                Err(CoordError::Deadline(what.into()))
            }
            Ok(r) => r,
        }
    }

    pub async fn get(&self, r: GetDocumentsRequest) -> Result<GetDocumentsResponse> {
        let names = (r.collection.as_str(), r.collection.as_str());
        let read = self.read(names, &r.read_token, r.consistency, r.timeout_ms)?;
        if r.ids.is_empty() {
            return Err(CoordError::invalid("ids", "is empty"));
        }
        let max = self.max_batch.min(MAX_DOCS_PER_BATCH);
        if r.ids.len() > max {
            return Err(CoordError::TooLarge {
                field: "ids".into(),
                reason: format!("at most {max} per call (limits.max_batch_documents)"),
            });
        }
        let mut ids = Vec::with_capacity(r.ids.len());
        let mut seen = HashSet::new();
        let mut per_shard: HashMap<u32, Vec<String>> = HashMap::new();
        for (i, id) in r.ids.into_iter().enumerate() {
            check_id(&format!("ids[{i}]"), &id)?;
            if seen.insert(id.clone()) {
                let shard = placement::shard_for_doc(&id, read.info.shard_count);
                per_shard.entry(shard).or_default().push(id.clone());
                ids.push(id);
            }
        }
        let plan = read.plan();
        let (targets, _inflight) = self.shards.targets(&plan);
        let calls = per_shard.into_iter().map(|(shard, ids)| {
            let node = targets[shard as usize].clone();
            let plan = &plan;
            async move {
                self.shards
                    .documents(plan, shard, &node, ids, r.with_embedding)
                    .await
            }
        });
        let answers = Self::timed("GetDocuments", read.deadline, async {
            join_all(calls)
                .await
                .into_iter()
                .collect::<Result<Vec<_>>>()
        })
        .await?;
        let mut by_doc: HashMap<String, Vec<Chunk>> = HashMap::new();
        for c in answers.into_iter().flatten() {
            by_doc.entry(c.doc_id.clone()).or_default().push(c);
        }
        let mut out = GetDocumentsResponse::default();
        for id in ids {
            match by_doc.remove(&id) {
                Some(chunks) => out.documents.push(stored(id, chunks)),
                None => out.not_found.push(id),
            }
        }
        Ok(out)
    }

    /// The collection a scroll named by an alias goes on reading: the one its cursor began
    /// on, when the alias was switched since and that collection still stands (a scroll ends
    /// where it started, as a point in time does). None: the one named.
    fn scroll_collection(&self, r: &ScrollRequest) -> Option<String> {
        self.catalog.alias_target(&r.collection)?;
        let t = cursor_body(&r.cursor)?.token?;
        let began = self.catalog.get_exact(&t.collection)?;
        (began.created_at_ms == t.created_at_ms).then_some(t.collection)
    }

    pub async fn scroll(&self, r: ScrollRequest) -> Result<ScrollResponse> {
        let on = self.scroll_collection(&r);
        let names = (
            on.as_deref().unwrap_or(&r.collection),
            r.collection.as_str(),
        );
        let mut read = self.read(names, &r.read_token, r.consistency, r.timeout_ms)?;
        check_filter(&r.filter, r.conditions.as_ref(), &read.info)?;
        let limit = match r.limit {
            0 => DEFAULT_SCROLL_LIMIT,
            l if l > MAX_SCROLL_LIMIT => {
                return Err(CoordError::invalid(
                    "limit",
                    format!("must be in [1, {MAX_SCROLL_LIMIT}], got {l}"),
                ));
            }
            l => l,
        };
        let after = parse_cursor(&r, &read.info, names.0)?;
        if let Some((_, _, t)) = &after {
            read.token.merge(t);
        }
        let req = ScanRequest {
            after: after.is_some(),
            after_doc_id: after.as_ref().map(|a| a.0.clone()).unwrap_or_default(),
            after_position: after.as_ref().map_or(0, |a| a.1),
            limit: per_shard(limit, read.info.shards.len()),
            filter: r.filter.clone(),
            conditions: r.conditions.clone(),
            with_embedding: r.with_embedding,
            max_bytes: MAX_SCROLL_PAGE_BYTES as u64,
            ..Default::default()
        };
        let plan = read.plan();
        let (targets, _inflight) = self.shards.targets(&plan);
        let calls = targets
            .iter()
            .enumerate()
            .map(|(shard, node)| self.shards.scan(&plan, shard as u32, node, req.clone()));
        let answers = Self::timed("Scroll", read.deadline, async {
            join_all(calls)
                .await
                .into_iter()
                .collect::<Result<Vec<_>>>()
        })
        .await?;
        let mut token = read.token.clone();
        for (shard, a) in answers.iter().enumerate() {
            token.raise(shard as u32, a.seq);
        }
        let (chunks, more) = merge_page(answers, limit as usize);
        let next_cursor = match chunks.last() {
            Some(last) if more => encode_cursor(
                last,
                &token,
                &read.info,
                query_hash(&r.filter, r.conditions.as_ref(), r.with_embedding),
            ),
            _ => String::new(),
        };
        Ok(ScrollResponse {
            chunks,
            next_cursor,
        })
    }

    pub async fn count(&self, r: CountRequest) -> Result<CountResponse> {
        let names = (r.collection.as_str(), r.collection.as_str());
        let read = self.read(names, &r.read_token, r.consistency, r.timeout_ms)?;
        check_filter(&r.filter, r.conditions.as_ref(), &read.info)?;
        let plan = read.plan();
        let (targets, _inflight) = self.shards.targets(&plan);
        let calls = targets.iter().enumerate().map(|(shard, node)| {
            let req = ShardCountRequest {
                filter: r.filter.clone(),
                conditions: r.conditions.clone(),
                ..Default::default()
            };
            self.shards.count(&plan, shard as u32, node, req)
        });
        let answers = Self::timed("Count", read.deadline, async {
            join_all(calls)
                .await
                .into_iter()
                .collect::<Result<Vec<_>>>()
        })
        .await?;
        // A document lives on one shard: per-shard document counts add up.
        Ok(CountResponse {
            chunks: answers.iter().map(|a| a.chunks).sum(),
            documents: answers.iter().map(|a| a.documents).sum(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(doc: &str, position: u32) -> Chunk {
        Chunk {
            chunk_id: format!("{doc}#{position}"),
            doc_id: doc.into(),
            position,
            text: "t".into(),
            ..Default::default()
        }
    }

    fn scan(chunks: &[(&str, u32)], done: bool) -> ScanResponse {
        ScanResponse {
            chunks: chunks.iter().map(|(d, p)| chunk(d, *p)).collect(),
            done,
            seq: 1,
        }
    }

    fn keys(chunks: &[Chunk]) -> Vec<(String, u32)> {
        chunks
            .iter()
            .map(|c| (c.doc_id.clone(), c.position))
            .collect()
    }

    /// A page ends at the smallest last key of the shards that stopped early: a chunk past it
    /// may be preceded by one the stopped shard did not send yet.
    #[test]
    fn a_page_ends_where_every_shard_is_complete() {
        let answers = vec![
            scan(&[("a", 0), ("a", 1), ("d", 0)], false),
            scan(&[("b", 0), ("c", 0), ("e", 0)], true),
        ];
        let (page, more) = merge_page(answers, 10);
        assert_eq!(
            keys(&page),
            [
                ("a".into(), 0),
                ("a".into(), 1),
                ("b".into(), 0),
                ("c".into(), 0),
                ("d".into(), 0)
            ]
        );
        assert!(more);
        // Everyone done: everything, in order, and nothing more.
        let (page, more) = merge_page(vec![scan(&[("b", 0)], true), scan(&[("a", 2)], true)], 10);
        assert_eq!(keys(&page), [("a".into(), 2), ("b".into(), 0)]);
        assert!(!more);
        // The limit cuts a complete page.
        let (page, more) = merge_page(vec![scan(&[("b", 0)], true), scan(&[("a", 2)], true)], 1);
        assert_eq!(keys(&page), [("a".into(), 2)]);
        assert!(more);
    }

    #[test]
    fn a_page_stops_before_the_byte_cap_but_holds_one_chunk() {
        let big = |doc: &str| Chunk {
            text: "x".repeat(MAX_SCROLL_PAGE_BYTES / 2),
            ..chunk(doc, 0)
        };
        let answers = vec![ScanResponse {
            chunks: vec![big("a"), big("b"), big("c")],
            done: true,
            seq: 1,
        }];
        let (page, more) = merge_page(answers, 10);
        assert_eq!(page.len(), 1);
        assert!(more);
        let huge = ScanResponse {
            chunks: vec![Chunk {
                text: "x".repeat(MAX_SCROLL_PAGE_BYTES + 1),
                ..chunk("a", 0)
            }],
            done: true,
            seq: 1,
        };
        assert_eq!(merge_page(vec![huge], 10).0.len(), 1);
    }

    #[test]
    fn a_cursor_round_trips_and_is_refused_for_another_filter() {
        let info = CollectionInfo {
            name: "docs".into(),
            created_at_ms: 5,
            shards: vec![ShardPlacement::default(); 2],
            ..Default::default()
        };
        let mut token = ReadToken::default();
        token.raise(1, 42);
        let filter: HashMap<String, String> = [("lang".to_owned(), "en".to_owned())].into();
        let cursor = encode_cursor(
            &chunk("doc-7", 3),
            &token,
            &info,
            query_hash(&filter, None, false),
        );
        let mut r = ScrollRequest {
            collection: "docs".into(),
            filter: filter.clone(),
            cursor,
            ..Default::default()
        };
        let (doc, pos, t) = parse_cursor(&r, &info, "docs").unwrap().unwrap();
        assert_eq!((doc.as_str(), pos, t.min_applied(1)), ("doc-7", 3, 42));
        r.with_embedding = true;
        assert!(
            parse_cursor(&r, &info, "docs")
                .unwrap_err()
                .to_string()
                .contains("another filter")
        );
        r.with_embedding = false;
        r.filter.insert("lang".into(), "de".into());
        assert!(parse_cursor(&r, &info, "docs").is_err());
        r.filter = filter;
        for bad in ["sc1.!!", "xyz", "sc1.AAAA_w"] {
            r.cursor = bad.into();
            let e = parse_cursor(&r, &info, "docs").unwrap_err();
            assert!(e.to_string().starts_with("cursor: "), "{e}");
        }
        r.cursor = "x".repeat(MAX_CURSOR_BYTES + 1);
        assert!(
            parse_cursor(&r, &info, "docs")
                .unwrap_err()
                .to_string()
                .contains("at most")
        );
    }
}
