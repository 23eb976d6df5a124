//! Writes that change stored documents in place: metadata patches (UpdateDocuments) and
//! deletes by id or by filter (DeleteDocuments). The whole request is checked here (ids, the
//! filter against the schema, the patch's keys and value types) before any shard is called;
//! each shard then gets one `DocumentChange` and selects the documents itself when it applies
//! the entry (`shard-node/src/shard/changes.rs`). So a filter sees exactly the documents
//! stored at that point of the shard's log, nothing is re-chunked or re-embedded, and each
//! shard's part is one atomic write. A call that fails on some shards reports, per shard,
//! what was applied (as an upsert reports per document).

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use ragcluster_proto::v1::*;

use super::{Ingestor, check_collection, check_id, raise};
use crate::error::{CoordError, Result};
use crate::limits::{MAX_DOC_FIELDS, MAX_DOCS_PER_BATCH, MAX_METADATA_ENTRIES, MAX_PATCH_ENTRIES};
use crate::placement;
use crate::read_token::ReadToken;
use crate::schema::{self, SECTION};
use crate::shards::Batch;

/// Which documents a change selects.
enum Selection {
    /// By id, grouped by the shard that owns each.
    Ids(BTreeMap<u32, Vec<String>>),
    /// Every document of every shard with a chunk that matches.
    Filter(Filter),
}

/// Checks `ids` / `conditions` whole (exactly one of them; a filter against the schema; an
/// empty filter only where `empty_filter` says what it means).
fn select(
    ids: &[String],
    conditions: Option<&Filter>,
    info: &CollectionInfo,
    max_ids: usize,
    empty_filter: Option<&str>,
) -> Result<Selection> {
    match (ids.is_empty(), conditions) {
        (false, Some(_)) => Err(CoordError::invalid(
            "conditions",
            "is set together with ids: give one of them",
        )),
        (true, None) => Err(CoordError::invalid(
            "ids",
            "is empty (give ids or conditions)",
        )),
        (true, Some(f)) => {
            schema::check_filter("conditions", f, info)?;
            let empty = f.must.is_empty() && f.should.is_empty() && f.must_not.is_empty();
            if let (true, Some(why)) = (empty, empty_filter) {
                return Err(CoordError::invalid("conditions", why));
            }
            Ok(Selection::Filter(f.clone()))
        }
        (false, None) => {
            let max = max_ids.min(MAX_DOCS_PER_BATCH);
            if ids.len() > max {
                return Err(CoordError::TooLarge {
                    field: "ids".into(),
                    reason: format!("at most {max} per call (limits.max_batch_documents)"),
                });
            }
            let mut seen = HashSet::new();
            let mut per_shard: BTreeMap<u32, Vec<String>> = BTreeMap::new();
            for (i, id) in ids.iter().enumerate() {
                check_id(&format!("ids[{i}]"), id)?;
                if !seen.insert(id) {
                    return Err(CoordError::invalid(
                        format!("ids[{i}]"),
                        format!("{id:?} appears more than once"),
                    ));
                }
                per_shard
                    .entry(placement::shard_for_doc(id, info.shard_count))
                    .or_default()
                    .push(id.clone());
            }
            Ok(Selection::Ids(per_shard))
        }
    }
}

/// Checks a patch whole: it changes something, within `MAX_PATCH_ENTRIES`, names valid,
/// `section` untouched, no key both set and deleted, values of their fields' types. Returns
/// the fields it adds to the schema.
pub fn check_patch(p: Option<&MetadataPatch>, info: &CollectionInfo) -> Result<Vec<FieldSchema>> {
    let Some(p) = p.filter(|p| !shard_patch_is_empty(p)) else {
        return Err(CoordError::invalid("patch", "changes nothing"));
    };
    let entries =
        p.set_metadata.len() + p.delete_metadata.len() + p.set_fields.len() + p.delete_fields.len();
    if entries > MAX_PATCH_ENTRIES {
        return Err(CoordError::TooLarge {
            field: "patch".into(),
            reason: format!("{entries} entries, at most {MAX_PATCH_ENTRIES}"),
        });
    }
    let set: HashSet<&str> = p
        .set_metadata
        .keys()
        .chain(p.set_fields.keys())
        .map(String::as_str)
        .collect();
    for (list, name) in [
        (&p.delete_metadata, "delete_metadata"),
        (&p.delete_fields, "delete_fields"),
    ] {
        for (i, k) in list.iter().enumerate() {
            let path = format!("patch.{name}[{i}]");
            schema::check_field_name(&path, k)?;
            if set.contains(k.as_str()) {
                return Err(CoordError::invalid(path, format!("{k:?} is also set")));
            }
        }
    }
    let named = p
        .set_metadata
        .keys()
        .map(|k| ("set_metadata", k))
        .chain(p.set_fields.keys().map(|k| ("set_fields", k)))
        .chain(p.delete_metadata.iter().map(|k| ("delete_metadata", k)))
        .chain(p.delete_fields.iter().map(|k| ("delete_fields", k)));
    for (list, k) in named {
        if k == SECTION {
            return Err(CoordError::invalid(
                format!("patch.{list}"),
                format!("{SECTION:?} is set by chunking and cannot be changed"),
            ));
        }
        if k.contains('\u{1f}') {
            return Err(CoordError::invalid(
                format!("patch.{list}[{k:?}]"),
                "has U+001F",
            ));
        }
    }
    schema::patch_growth(p, info)
}

fn shard_patch_is_empty(p: &MetadataPatch) -> bool {
    p.set_metadata.is_empty()
        && p.delete_metadata.is_empty()
        && p.set_fields.is_empty()
        && p.delete_fields.is_empty()
}

/// Each shard's change for `sel`.
fn per_shard(
    sel: Selection,
    info: &CollectionInfo,
    delete: bool,
    patch: Option<MetadataPatch>,
) -> BTreeMap<u32, Batch> {
    let change = |doc_ids: Vec<String>, conditions: Option<Filter>| DocumentChange {
        doc_ids,
        conditions,
        delete,
        patch: patch.clone(),
        max_metadata: MAX_METADATA_ENTRIES as u32,
        max_fields: MAX_DOC_FIELDS as u32,
    };
    match sel {
        Selection::Ids(m) => m
            .into_iter()
            .map(|(s, ids)| (s, Batch::Changes(vec![change(ids, None)])))
            .collect(),
        Selection::Filter(f) => (0..info.shard_count)
            .map(|s| (s, Batch::Changes(vec![change(Vec::new(), Some(f.clone()))])))
            .collect(),
    }
}

/// What the shards did, summed, with each shard's result; Err (carrying the summary in its
/// details) when some shard failed.
struct Outcome {
    changed: u32,
    not_found: Vec<String>,
    shards: Vec<ShardResult>,
    failed: Option<(CoordError, usize)>,
}

fn outcome(results: Vec<(u32, Vec<String>, Result<WriteBatchResponse>)>) -> Outcome {
    let mut o = Outcome {
        changed: 0,
        not_found: Vec::new(),
        shards: Vec::new(),
        failed: None,
    };
    for (shard, _, r) in results {
        match r {
            Ok(w) => {
                o.changed += w.changed;
                o.not_found.extend(w.not_found);
                o.shards.push(ShardResult {
                    shard,
                    applied: true,
                    documents: w.changed,
                    ..Default::default()
                });
            }
            Err(e) => {
                o.shards.push(ShardResult {
                    shard,
                    applied: false,
                    documents: 0,
                    code: e.to_status_code() as i32,
                    message: e.to_string(),
                });
                match &mut o.failed {
                    Some((_, n)) => *n += 1,
                    None => o.failed = Some((e, 1)),
                }
            }
        }
    }
    o
}

/// The error of a call that failed on some shards: the first failure's code, and `details`
/// (the response, encoded) saying what each shard did.
fn partial(
    what: &str,
    first: CoordError,
    failed: usize,
    total: usize,
    details: Vec<u8>,
) -> CoordError {
    CoordError::Partial {
        code: first.to_status_code(),
        reason: format!(
            "{what} not applied on {failed} of {total} shards ({first}); the other shards \
             applied it (the status details say which); retrying the whole call is safe"
        ),
        retry_after_ms: first.retry_after_ms().unwrap_or(500),
        details,
    }
}

impl Ingestor {
    /// Deletes documents by id or by filter (`DeleteDocumentsRequest`).
    pub async fn delete(
        &self,
        r: DeleteDocumentsRequest,
        client_timeout: Option<Duration>,
    ) -> Result<DeleteDocumentsResponse> {
        let started = std::time::Instant::now();
        check_collection("collection", &r.collection)?;
        let (info, mirror) = self.catalog.write_route(&r.collection)?;
        let sel = select(
            &r.ids,
            r.conditions.as_ref(),
            &info,
            self.max_batch,
            Some("is empty: it would delete every document (drop the collection instead)"),
        )?;
        let mut token = ReadToken::parse("read_token", &r.read_token, &info, &r.collection)?;
        let timeout = self.timeout(client_timeout, started);
        let batches = per_shard(sel, &info, true, None);
        let total = batches.len();
        let results = (self.write_shards(&info, batches, mirror.as_ref(), timeout)).await;
        if let Some(m) = &mirror {
            let timeout = self.timeout(client_timeout, started);
            self.mirror_changes(&info, m, &results, timeout).await?;
        }
        raise(&mut token, &results);
        let o = outcome(results);
        let response = DeleteDocumentsResponse {
            deleted: o.changed,
            not_found: o.not_found,
            shards: o.shards,
            read_token: token.encode(&info),
        };
        match o.failed {
            None => Ok(response),
            Some((first, n)) => Err(partial(
                "the delete was",
                first,
                n,
                total,
                prost::Message::encode_to_vec(&response),
            )),
        }
    }

    /// Patches documents' metadata by id or by filter (`UpdateDocumentsRequest`). The service
    /// adds the fields the patch sets to the schema first.
    pub async fn update(
        &self,
        r: UpdateDocumentsRequest,
        client_timeout: Option<Duration>,
    ) -> Result<UpdateDocumentsResponse> {
        let started = std::time::Instant::now();
        check_collection("collection", &r.collection)?;
        let (info, mirror) = self.catalog.write_route(&r.collection)?;
        let sel = select(&r.ids, r.conditions.as_ref(), &info, self.max_batch, None)?;
        check_patch(r.patch.as_ref(), &info)?;
        let mut token = ReadToken::parse("read_token", &r.read_token, &info, &r.collection)?;
        let timeout = self.timeout(client_timeout, started);
        let batches = per_shard(sel, &info, false, r.patch);
        let total = batches.len();
        let results = (self.write_shards(&info, batches, mirror.as_ref(), timeout)).await;
        if let Some(m) = &mirror {
            let timeout = self.timeout(client_timeout, started);
            self.mirror_changes(&info, m, &results, timeout).await?;
        }
        raise(&mut token, &results);
        let o = outcome(results);
        let response = UpdateDocumentsResponse {
            updated: o.changed,
            not_found: o.not_found,
            shards: o.shards,
            read_token: token.encode(&info),
        };
        metrics::counter!("coordinator_updated_documents_total")
            .increment(u64::from(response.updated));
        match o.failed {
            None => Ok(response),
            Some((first, n)) => Err(partial(
                "the update was",
                first,
                n,
                total,
                prost::Message::encode_to_vec(&response),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> CollectionInfo {
        CollectionInfo {
            name: "c".into(),
            shard_count: 3,
            fields: vec![FieldSchema {
                name: "year".into(),
                r#type: FieldType::Integer as i32,
            }],
            ..Default::default()
        }
    }

    fn int(i: i64) -> Value {
        Value {
            kind: Some(value::Kind::Integer(i)),
        }
    }

    #[test]
    fn patches_are_checked_whole_naming_the_path() {
        let err = |p: MetadataPatch| check_patch(Some(&p), &info()).unwrap_err().to_string();
        assert!(err(MetadataPatch::default()).contains("patch: changes nothing"));
        let kw = |k: &str| MetadataPatch {
            set_metadata: [(k.to_owned(), "x".to_owned())].into(),
            ..Default::default()
        };
        assert!(err(kw("section")).contains("set by chunking"));
        assert!(err(kw("year")).contains("patch.set_metadata[\"year\"]"));
        let both = MetadataPatch {
            delete_metadata: vec!["lang".into()],
            ..kw("lang")
        };
        assert!(err(both).contains("patch.delete_metadata[0]"));
        let float = MetadataPatch {
            set_fields: [(
                "year".to_owned(),
                Value {
                    kind: Some(value::Kind::Float(1.5)),
                },
            )]
            .into(),
            ..Default::default()
        };
        assert!(err(float).contains("patch.set_fields[\"year\"]"));
        let many = MetadataPatch {
            delete_fields: (0..=MAX_PATCH_ENTRIES).map(|i| format!("f{i}")).collect(),
            ..Default::default()
        };
        assert!(matches!(
            check_patch(Some(&many), &info()),
            Err(CoordError::TooLarge { .. })
        ));
        let grows = MetadataPatch {
            set_fields: [("views".to_owned(), int(3)), ("year".to_owned(), int(2020))].into(),
            ..kw("lang")
        };
        let added = check_patch(Some(&grows), &info()).unwrap();
        let names: Vec<&str> = added.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["lang", "views"]);
    }

    #[test]
    fn selections_are_ids_or_a_filter() {
        let i = info();
        let err = |ids: &[&str], f: Option<Filter>, empty: Option<&str>| {
            let ids: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
            match select(&ids, f.as_ref(), &i, 256, empty) {
                Err(e) => e.to_string(),
                Ok(_) => "ok".into(),
            }
        };
        assert!(err(&[], None, None).contains("ids: is empty"));
        assert!(err(&["a"], Some(Filter::default()), None).contains("conditions"));
        assert!(err(&["a", "a"], None, None).contains("ids[1]"));
        assert_eq!(err(&[], Some(Filter::default()), None), "ok");
        assert!(err(&[], Some(Filter::default()), Some("is empty")).contains("is empty"));
        let unknown = Filter {
            must: vec![Condition {
                kind: Some(condition::Kind::Exists("nope".into())),
            }],
            ..Default::default()
        };
        assert!(err(&[], Some(unknown), None).contains("conditions.must[0]"));
    }
}
