//! Changing stored documents in place: `ragctl update` (set and delete metadata keys and typed
//! fields without re-embedding) and `ragctl delete` (by id or by filter).

use std::collections::{BTreeMap, HashMap};

use anyhow::{Context, Result, bail};
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;

use super::browse;
use crate::{Cli, channel};

/// `ragctl update`.
#[derive(clap::Args, Debug)]
pub struct UpdateArgs {
    /// Document ids to change (at most 256); or select them with --where.
    ids: Vec<String>,
    /// The collection (or an alias of it).
    #[arg(long, default_value = "docs")]
    collection: String,
    /// Every document with a chunk matching this typed filter expression (as `ragctl count`).
    #[arg(long = "where")]
    where_: Option<String>,
    /// key=value to set (repeatable): a field of the schema takes its type (integers,
    /// floats, true/false, RFC 3339 datetimes, comma-separated keyword lists); any other key
    /// is string metadata.
    #[arg(long = "set")]
    set: Vec<String>,
    /// Typed fields as a JSON object, e.g. '{"year": 2021, "tags": ["a", "b"],
    /// "seen": {"datetime": "2024-05-01T00:00:00Z"}}'.
    #[arg(long = "set-json")]
    set_json: Option<String>,
    /// Keys to delete, as metadata and as typed fields (repeatable).
    #[arg(long = "unset")]
    unset: Vec<String>,
    /// Print the response as JSON.
    #[arg(long)]
    json: bool,
}

/// `ragctl delete`.
#[derive(clap::Args, Debug)]
pub struct DeleteArgs {
    /// Document ids to delete (at most 256); or select them with --where.
    ids: Vec<String>,
    /// The collection (or an alias of it).
    #[arg(long, default_value = "docs")]
    collection: String,
    /// Every document with a chunk matching this typed filter expression.
    #[arg(long = "where")]
    where_: Option<String>,
    /// Print the response as JSON.
    #[arg(long)]
    json: bool,
}

async fn schema(cli: &Cli, collection: &str) -> Result<BTreeMap<String, FieldType>> {
    let info = CoordinatorClient::new(channel(cli).await?)
        .describe_collection(DescribeCollectionRequest {
            name: collection.to_owned(),
        })
        .await?
        .into_inner()
        .collection
        .unwrap_or_default();
    Ok(info
        .fields
        .iter()
        .map(|f| (f.name.clone(), f.r#type()))
        .collect())
}

/// The patch `--set`, `--set-json` and `--unset` describe, values read by `schema`.
pub fn patch(
    set: &[String],
    set_json: Option<&str>,
    unset: &[String],
    schema: &BTreeMap<String, FieldType>,
) -> Result<MetadataPatch> {
    let mut p = MetadataPatch::default();
    for s in set {
        let (k, v) = s.split_once('=').context("--set takes key=value")?;
        match schema.get(k).copied() {
            None | Some(FieldType::Keyword | FieldType::Unspecified) => {
                p.set_metadata.insert(k.to_owned(), v.to_owned());
            }
            Some(FieldType::KeywordList) => {
                let values = v.split(',').map(|x| x.trim().to_owned()).collect();
                let kind = value::Kind::Keywords(KeywordList { values });
                p.set_fields
                    .insert(k.to_owned(), Value { kind: Some(kind) });
            }
            Some(t) => {
                let kind =
                    ragctl::filter::typed(v, t).map_err(|e| anyhow::anyhow!("--set {k}: {e}"))?;
                p.set_fields
                    .insert(k.to_owned(), Value { kind: Some(kind) });
            }
        }
    }
    if let Some(j) = set_json {
        let m: HashMap<String, serde_json::Value> =
            serde_json::from_str(j).context("--set-json takes a JSON object")?;
        for (k, v) in m {
            let v =
                super::ingest::json_value(v).map_err(|e| anyhow::anyhow!("--set-json {k}: {e}"))?;
            p.set_fields.insert(k, v);
        }
    }
    for k in unset {
        p.delete_metadata.push(k.clone());
        p.delete_fields.push(k.clone());
    }
    if is_empty(&p) {
        bail!("nothing to change: give --set, --set-json or --unset");
    }
    Ok(p)
}

fn is_empty(p: &MetadataPatch) -> bool {
    p.set_metadata.is_empty()
        && p.set_fields.is_empty()
        && p.delete_metadata.is_empty()
        && p.delete_fields.is_empty()
}

fn print_shards(shards: &[ShardResult]) {
    for s in shards.iter().filter(|s| !s.applied) {
        eprintln!("shard {}: not applied ({})", s.shard, s.message);
    }
}

/// `ragctl update`.
pub async fn update(cli: &Cli, a: &UpdateArgs) -> Result<()> {
    let schema = schema(cli, &a.collection).await?;
    let patch = patch(&a.set, a.set_json.as_deref(), &a.unset, &schema)?;
    let r = CoordinatorClient::new(channel(cli).await?)
        .update_documents(UpdateDocumentsRequest {
            collection: a.collection.clone(),
            ids: a.ids.clone(),
            conditions: browse::conditions(cli, &a.collection, a.where_.as_deref()).await?,
            patch: Some(patch),
            ..Default::default()
        })
        .await?
        .into_inner();
    let out = Outcome {
        verb: "updated",
        count: r.updated,
        not_found: &r.not_found,
        read_token: &r.read_token,
        shards: &r.shards,
    };
    out.print(a.json);
    Ok(())
}

/// `ragctl delete`.
pub async fn delete(cli: &Cli, a: &DeleteArgs) -> Result<()> {
    let r = CoordinatorClient::new(channel(cli).await?)
        .delete_documents(DeleteDocumentsRequest {
            collection: a.collection.clone(),
            ids: a.ids.clone(),
            conditions: browse::conditions(cli, &a.collection, a.where_.as_deref()).await?,
            ..Default::default()
        })
        .await?
        .into_inner();
    let out = Outcome {
        verb: "deleted",
        count: r.deleted,
        not_found: &r.not_found,
        read_token: &r.read_token,
        shards: &r.shards,
    };
    out.print(a.json);
    Ok(())
}

/// What an update or delete did, printed the same way for both.
struct Outcome<'a> {
    verb: &'static str,
    count: u32,
    not_found: &'a [String],
    read_token: &'a str,
    shards: &'a [ShardResult],
}

impl Outcome<'_> {
    fn print(&self, json: bool) {
        print_shards(self.shards);
        if json {
            let mut v =
                serde_json::json!({"not_found": self.not_found, "read_token": self.read_token});
            v[self.verb] = self.count.into();
            println!("{v}");
        } else {
            println!("{} {} documents", self.verb, self.count);
            if !self.not_found.is_empty() {
                println!("not found: {}", self.not_found.join(", "));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_reads_values_by_the_schema() {
        let schema: BTreeMap<String, FieldType> = [
            ("year".to_owned(), FieldType::Integer),
            ("tags".to_owned(), FieldType::KeywordList),
        ]
        .into();
        let p = patch(
            &["year=2021".into(), "lang=en".into(), "tags=a, b".into()],
            Some(r#"{"score": 0.5}"#),
            &["draft".into()],
            &schema,
        )
        .unwrap();
        assert_eq!(p.set_metadata["lang"], "en");
        assert_eq!(p.set_fields["year"].kind, Some(value::Kind::Integer(2021)));
        assert_eq!(
            p.set_fields["tags"].kind,
            Some(value::Kind::Keywords(KeywordList {
                values: vec!["a".into(), "b".into()]
            }))
        );
        assert_eq!(p.set_fields["score"].kind, Some(value::Kind::Float(0.5)));
        assert_eq!(p.delete_metadata, ["draft"]);
        assert!(patch(&["year=soon".into()], None, &[], &schema).is_err());
        assert!(patch(&[], None, &[], &schema).is_err());
    }
}
