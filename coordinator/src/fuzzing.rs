//! Entry points of the fuzz targets (`fuzz/`, cargo-fuzz) and of the test that replays their
//! committed corpora on stable Rust. Each takes arbitrary bytes and must neither panic nor
//! hang; the assertions are the properties fuzzing checks beyond "no crash".

use prost::Message;
use ragcluster_proto::v1::{AskRequest, CollectionInfo, SearchRequest, UpsertDocumentsRequest};

use crate::chunking::{self, ChunkParams, Strategy, WordTokens};

/// Chunkers: the first two bytes pick the strategy and sizes, the rest is the document.
/// Every chunk must be a verbatim piece of the document and the chunker must terminate.
pub fn chunkers(data: &[u8]) {
    if data.len() < 2 {
        return;
    }
    let Ok(text) = std::str::from_utf8(&data[2..]) else {
        return;
    };
    let strategy = match data[0] % 3 {
        0 => Strategy::Fixed,
        1 => Strategy::Sentence,
        _ => Strategy::Markdown,
    };
    let chunk_size = 1 + usize::from(data[1] % 64);
    let p = ChunkParams {
        strategy,
        chunk_size,
        overlap: usize::from(data[1] / 64) % chunk_size,
        min_tokens: usize::from(data[0] / 3) % 8,
    };
    for c in chunking::chunk(text, &p, &WordTokens) {
        assert!(
            text.contains(c.text.as_str()),
            "{strategy:?} chunk is not a verbatim slice of the document: {:?}",
            c.text
        );
    }
}

/// The flow config parser: a flow file, and the same text as an inline flow checked against
/// the shipped flows (what Ask does with `inline_flow`).
pub fn flow_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = crate::flow::spec::FlowSet::parse(text);
    if let Ok(t) = text.parse::<toml::Table>()
        && let Ok(f) = crate::flow::spec::parse_flow("inline", &toml::Value::Table(t))
        && let Ok(set) = crate::flow::spec::FlowSet::parse(crate::flow::EXAMPLE_FLOWS)
    {
        let _ = set.validate_inline(&f);
    }
}

/// Request validators: the bytes as each request message (as a hostile client could send
/// them), through the checks that run before any work.
pub fn request_validators(data: &[u8]) {
    if let Ok(r) = UpsertDocumentsRequest::decode(data) {
        let _ =
            crate::ingest::validate_documents(&r.documents, crate::limits::MAX_DOCS_PER_BATCH, 384);
    }
    if let Ok(r) = SearchRequest::decode(data)
        && let Ok(p) = crate::service::convert::search_query(
            &r,
            &CollectionInfo {
                name: r.collection.clone(),
                dimension: 384,
                shards: vec![Default::default(); 3],
                ..Default::default()
            },
            std::time::Duration::from_secs(5),
            crate::limits::MAX_SEARCH_TOP_K,
        )
    {
        assert!(p.top_k >= 1 && p.top_k <= crate::limits::MAX_SEARCH_TOP_K as usize);
        assert!(p.candidates >= p.top_k);
    }
    if let Ok(r) = AskRequest::decode(data) {
        if let Some(o) = &r.overrides {
            let _ = crate::flow::overrides(o, 1024);
        }
        if let Ok(t) = r.inline_flow.parse::<toml::Table>() {
            let _ = crate::flow::spec::parse_flow("inline", &toml::Value::Table(t));
        }
    }
    let md = {
        let mut m = tonic::metadata::MetadataMap::new();
        if let Ok(s) = std::str::from_utf8(data)
            && let Ok(v) = s.parse()
        {
            m.insert(ragcluster_common::client::AUTHORIZATION, v);
        }
        m
    };
    if let Some(k) = ragcluster_common::client::api_key(&md) {
        let _ = crate::auth::verify(None, k, 0);
    }
}
