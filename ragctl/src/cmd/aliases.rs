//! `ragctl alias set|switch|delete|list`: names that stand for collections, switched
//! atomically (for example to a re-built collection, then back).

use anyhow::Result;
use clap::Subcommand;
use ragcluster_common::client::KeyedChannel;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;

#[derive(Subcommand)]
pub enum AliasCmd {
    /// Point ALIAS at COLLECTION: creates it, or switches it atomically if it exists.
    Set {
        /// The alias ([a-z0-9_-], 1 to 64 characters; not a collection's name).
        alias: String,
        /// The collection it stands for.
        collection: String,
    },
    /// Delete aliases (all or none).
    Delete {
        /// The aliases to delete.
        #[arg(required = true)]
        aliases: Vec<String>,
    },
    /// Every alias (or those of one collection).
    List {
        /// Only the aliases of this collection.
        #[arg(long)]
        collection: Option<String>,
        /// Print the aliases as JSON.
        #[arg(long)]
        json: bool,
    },
}

fn print(aliases: &[Alias], json: bool) {
    if json {
        let v: Vec<_> = aliases
            .iter()
            .map(|a| serde_json::json!({ "alias": a.alias, "collection": a.collection }))
            .collect();
        println!("{}", serde_json::Value::Array(v));
    } else {
        for a in aliases {
            println!("{} -> {}", a.alias, a.collection);
        }
    }
}

pub async fn run(mut c: CoordinatorClient<KeyedChannel>, cmd: &AliasCmd) -> Result<()> {
    let actions = match cmd {
        AliasCmd::Set { alias, collection } => vec![AliasAction {
            action: Some(alias_action::Action::Put(Alias {
                alias: alias.clone(),
                collection: collection.clone(),
            })),
        }],
        AliasCmd::Delete { aliases } => aliases
            .iter()
            .map(|a| AliasAction {
                action: Some(alias_action::Action::Delete(a.clone())),
            })
            .collect(),
        AliasCmd::List { collection, json } => {
            let r = c
                .list_aliases(ListAliasesRequest {
                    collection: collection.clone().unwrap_or_default(),
                })
                .await?
                .into_inner();
            print(&r.aliases, *json);
            return Ok(());
        }
    };
    let r = c
        .update_aliases(UpdateAliasesRequest { actions })
        .await?
        .into_inner();
    print(&r.aliases, false);
    Ok(())
}
