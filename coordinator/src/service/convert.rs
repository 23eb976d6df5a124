//! Where the public wire meets the coordinator's domain: search requests become a checked
//! `search::Query` (every error names the field), results become responses.

use std::time::Duration;

use ragcluster_proto::v1::{
    CollectionInfo, Consistency as ConsistencyProto, RetrieverScore, SearchHit, SearchMode,
    SearchRequest, SearchResponse,
};

use crate::error::{CoordError, Result};
use crate::fusion::Fusion;
use crate::limits::{MAX_QUERY_BYTES, MAX_SEARCH_TIMEOUT_MS, MAX_SEARCH_TOP_K};
use crate::read_token::ReadToken;
use crate::search::query::{DEFAULT_CANDIDATES, DEFAULT_DENSE_WEIGHT, DEFAULT_RRF_K};
use crate::search::{Consistency, Hit, Mode, Query, Rank, Results};

fn mode(r: &SearchRequest) -> Result<Mode> {
    match SearchMode::try_from(r.mode) {
        Ok(SearchMode::Unspecified | SearchMode::Hybrid) => Ok(Mode::Hybrid),
        Ok(SearchMode::Bm25) => Ok(Mode::Bm25),
        Ok(SearchMode::Dense) => Ok(Mode::Dense),
        Err(_) => Err(CoordError::invalid(
            "mode",
            format!("unknown value {}", r.mode),
        )),
    }
}

fn fusion(r: &SearchRequest) -> Result<Fusion> {
    let w = r.dense_weight.unwrap_or(DEFAULT_DENSE_WEIGHT);
    if !(0.0..=1.0).contains(&w) {
        return Err(CoordError::invalid(
            "dense_weight",
            format!("must be in [0, 1], got {w}"),
        ));
    }
    let k = r.rrf_k.unwrap_or(DEFAULT_RRF_K);
    if !(1..=10_000).contains(&k) {
        return Err(CoordError::invalid("rrf_k", "must be in [1, 10000]"));
    }
    match r.fusion.as_str() {
        "" | "dbsf" => Ok(Fusion::Dbsf {
            lex_weight: 1.0 - w,
        }),
        "cc" => Ok(Fusion::Cc {
            lex_weight: 1.0 - w,
        }),
        "rrf" => Ok(Fusion::Rrf { k: k as f32 }),
        other => Err(CoordError::invalid(
            "fusion",
            format!("unknown fusion {other:?}; use rrf, cc or dbsf"),
        )),
    }
}

fn consistency(r: &SearchRequest) -> Result<Consistency> {
    match ConsistencyProto::try_from(r.consistency) {
        Ok(ConsistencyProto::Strong) => Ok(Consistency::Strong),
        Ok(ConsistencyProto::Eventual | ConsistencyProto::Unspecified) => Ok(Consistency::Eventual),
        Err(_) => Err(CoordError::invalid(
            "consistency",
            format!("unknown value {}", r.consistency),
        )),
    }
}

/// Checks a Search request against the collection's `dimension` and the limits.
/// `timeout_ms` of a Search or Ask: 0 (the default) up to `max`.
pub fn check_timeout(ms: u32, max: u32) -> Result<()> {
    if ms > max {
        return Err(CoordError::invalid(
            "timeout_ms",
            format!("{ms} is above the limit of {max}"),
        ));
    }
    Ok(())
}

/// Checks a Search request against its collection (`info`: dimension, shards, incarnation
/// for the read token) and the limits.
pub fn search_query(
    r: &SearchRequest,
    info: &CollectionInfo,
    default_timeout: Duration,
    max_top_k: u32,
) -> Result<Query> {
    let dimension = info.dimension;
    let max_top_k = max_top_k.min(MAX_SEARCH_TOP_K);
    if r.query.trim().is_empty() && r.query_vector.is_empty() {
        return Err(CoordError::invalid("query", "is empty"));
    }
    if r.query.len() > MAX_QUERY_BYTES {
        return Err(CoordError::invalid(
            "query",
            format!("is longer than {MAX_QUERY_BYTES} bytes"),
        ));
    }
    if r.top_k == 0 || r.top_k > max_top_k {
        return Err(CoordError::invalid(
            "top_k",
            format!("must be in [1, {max_top_k}], got {}", r.top_k),
        ));
    }
    let mode = mode(r)?;
    if mode != Mode::Dense && r.query.trim().is_empty() {
        return Err(CoordError::invalid(
            "query",
            "is empty (bm25 and hybrid need text)",
        ));
    }
    let fusion = fusion(r)?;
    if r.candidates > max_top_k {
        return Err(CoordError::invalid(
            "candidates",
            format!("must be at most {max_top_k}"),
        ));
    }
    // A single retriever needs no more than top_k; fusion needs a deeper pool per retriever.
    let candidates = match (r.candidates, mode) {
        (0, Mode::Hybrid) => r.top_k.max(DEFAULT_CANDIDATES),
        (0, _) => r.top_k,
        (c, _) => c.max(r.top_k),
    };
    if !r.query_vector.is_empty() && r.query_vector.len() != dimension as usize {
        return Err(CoordError::invalid(
            "query_vector",
            format!(
                "has dimension {}, collection expects {dimension}",
                r.query_vector.len()
            ),
        ));
    }
    if !r.query_vector.is_empty()
        && let Some(why) = crate::ingest::vector_problem(&r.query_vector)
    {
        return Err(CoordError::invalid("query_vector", why));
    }
    if r.exact && r.ef_search != 0 {
        return Err(CoordError::invalid(
            "ef_search",
            "must be 0 with exact (an exact search walks no graph)",
        ));
    }
    check_timeout(r.timeout_ms, MAX_SEARCH_TIMEOUT_MS)?;
    if r.filter.keys().any(String::is_empty) {
        return Err(CoordError::invalid("filter", "has an empty key"));
    }
    if let Some(f) = &r.conditions {
        crate::schema::check_filter("conditions", f, info)?;
    }
    let token = ReadToken::parse("read_token", &r.read_token, info, &r.collection)?;
    Ok(Query {
        collection: r.collection.clone(),
        text: r.query.clone(),
        vector: (!r.query_vector.is_empty()).then(|| r.query_vector.clone()),
        mode,
        fusion,
        top_k: r.top_k as usize,
        candidates: candidates as usize,
        filter: r.filter.clone(),
        conditions: r.conditions.clone(),
        ef_search: r.ef_search,
        exact: r.exact,
        ids_only: r.ids_only,
        consistency: consistency(r)?,
        token,
        timeout: match r.timeout_ms {
            0 => default_timeout,
            ms => Duration::from_millis(u64::from(ms)),
        },
    })
}

fn score(r: Option<Rank>) -> Option<RetrieverScore> {
    r.map(|r| RetrieverScore {
        rank: r.rank,
        score: r.score,
    })
}

pub fn search_hit(h: Hit) -> SearchHit {
    SearchHit {
        chunk_id: h.chunk_id,
        doc_id: h.doc_id,
        title: h.title,
        section: h.section,
        text: h.text,
        metadata: h.metadata,
        score: h.score,
        bm25: score(h.bm25),
        dense: score(h.dense),
        shard: h.shard,
        position: h.position,
    }
}

pub fn search_response(r: Results) -> SearchResponse {
    SearchResponse {
        hits: r.hits.into_iter().map(search_hit).collect(),
        took_us: r.took.as_micros() as u64,
        shards_total: r.shards_total,
        shards_ok: r.shards_ok,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> SearchRequest {
        SearchRequest {
            collection: "c".into(),
            query: "what is rust".into(),
            top_k: 10,
            ..Default::default()
        }
    }

    fn info() -> CollectionInfo {
        CollectionInfo {
            name: "c".into(),
            dimension: 4,
            created_at_ms: 1,
            shards: vec![Default::default(); 2],
            ..Default::default()
        }
    }

    fn field_of(r: SearchRequest) -> String {
        match search_query(&r, &info(), Duration::from_secs(1), MAX_SEARCH_TOP_K) {
            Err(CoordError::InvalidArgument { field, .. }) => field,
            Err(e) => panic!("unexpected {e}"),
            Ok(_) => "ok".into(),
        }
    }

    #[test]
    fn rejects_bad_requests_naming_the_field() {
        assert_eq!(field_of(req()), "ok");
        assert_eq!(
            field_of(SearchRequest {
                query: "  ".into(),
                ..req()
            }),
            "query"
        );
        assert_eq!(field_of(SearchRequest { top_k: 0, ..req() }), "top_k");
        assert_eq!(
            field_of(SearchRequest {
                top_k: MAX_SEARCH_TOP_K + 1,
                ..req()
            }),
            "top_k"
        );
        assert_eq!(
            field_of(SearchRequest {
                fusion: "borda".into(),
                ..req()
            }),
            "fusion"
        );
        assert_eq!(
            field_of(SearchRequest {
                dense_weight: Some(1.5),
                ..req()
            }),
            "dense_weight"
        );
        assert_eq!(
            field_of(SearchRequest {
                dense_weight: Some(-0.1),
                ..req()
            }),
            "dense_weight"
        );
        assert_eq!(
            field_of(SearchRequest {
                query_vector: vec![1.0; 3],
                ..req()
            }),
            "query_vector"
        );
        assert_eq!(field_of(SearchRequest { mode: 9, ..req() }), "mode");
        assert_eq!(
            field_of(SearchRequest {
                exact: true,
                ef_search: 128,
                ..req()
            }),
            "ef_search"
        );
        assert_eq!(
            field_of(SearchRequest {
                exact: true,
                ..req()
            }),
            "ok"
        );
        assert_eq!(
            field_of(SearchRequest {
                consistency: 9,
                ..req()
            }),
            "consistency"
        );
        assert_eq!(
            field_of(SearchRequest {
                read_token: "rt1.nope".into(),
                ..req()
            }),
            "read_token"
        );
    }

    #[test]
    fn defaults_are_the_tuned_dbsf() {
        let q = search_query(&req(), &info(), Duration::from_secs(1), MAX_SEARCH_TOP_K).unwrap();
        assert_eq!(q.mode, Mode::Hybrid);
        assert_eq!(
            q.fusion,
            Fusion::Dbsf {
                lex_weight: 1.0 - DEFAULT_DENSE_WEIGHT
            }
        );
        assert_eq!(q.candidates, 50);
    }
}
