//! `ragctl key create|list|revoke`: API keys in the replicated catalog (admin keys only).

use anyhow::{Result, bail};
use clap::Subcommand;
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use ragcluster_common::client::KeyedChannel;
use ragcluster_common::names::{parse_role, role_name};
use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::*;

#[derive(Subcommand)]
pub enum KeyCmd {
    /// Make a key; prints it once (only its hash is stored).
    Create {
        /// A label for people (who or what uses the key).
        name: String,
        /// reader (Search, Ask), writer (+ upsert/delete) or admin (+ collections, cluster).
        #[arg(long, default_value = "reader")]
        role: String,
        /// Limit the key to this collection (repeatable); none: all collections.
        #[arg(long = "collection")]
        collections: Vec<String>,
        /// Expire after this long, e.g. 30d or 12h; none: never.
        #[arg(long)]
        ttl: Option<humantime::Duration>,
        /// Print the key as JSON (with its secret).
        #[arg(long)]
        json: bool,
    },
    /// Every key (never the secrets).
    List {
        /// Print the keys as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Refuse a key from now on.
    Revoke {
        /// The key's id (as `key list` shows it).
        id: String,
    },
}

fn time(ms: u64) -> String {
    if ms == 0 {
        return "-".into();
    }
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms);
    humantime::format_rfc3339_seconds(t).to_string()
}

fn info_json(k: &ApiKeyInfo) -> serde_json::Value {
    serde_json::json!({
        "id": k.id,
        "name": k.name,
        "role": role_name(k.role()),
        "collections": k.collections,
        "created_at": time(k.created_at_ms),
        "expires_at": time(k.expires_at_ms),
        "revoked_at": time(k.revoked_at_ms),
    })
}

pub async fn run(admin: &mut AdminClient<KeyedChannel>, cmd: &KeyCmd) -> Result<()> {
    match cmd {
        KeyCmd::Create {
            name,
            role,
            collections,
            ttl,
            json,
        } => {
            let Some(r) = parse_role(role) else {
                bail!("--role must be reader, writer or admin, not {role:?}");
            };
            let resp = admin
                .create_api_key(CreateApiKeyRequest {
                    name: name.clone(),
                    role: r as i32,
                    collections: collections.clone(),
                    ttl_seconds: ttl.map_or(0, |d| d.as_secs().max(1)),
                })
                .await?
                .into_inner();
            let info = resp.key.unwrap_or_default();
            if *json {
                let mut v = info_json(&info);
                v["secret"] = serde_json::Value::String(resp.secret);
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                eprintln!(
                    "created key {} ({}, role {}, collections: {}, expires: {}); it is shown \
                     only now:",
                    info.id,
                    info.name,
                    role_name(info.role()),
                    if info.collections.is_empty() {
                        "all".into()
                    } else {
                        info.collections.join(",")
                    },
                    time(info.expires_at_ms)
                );
                println!("{}", resp.secret);
            }
        }
        KeyCmd::List { json } => {
            let keys = admin
                .list_api_keys(ListApiKeysRequest {})
                .await?
                .into_inner()
                .keys;
            if *json {
                let v: Vec<_> = keys.iter().map(info_json).collect();
                println!("{}", serde_json::to_string_pretty(&v)?);
                return Ok(());
            }
            let mut t = Table::new();
            t.load_preset(UTF8_FULL_CONDENSED).set_header([
                "id",
                "name",
                "role",
                "collections",
                "created",
                "expires",
                "revoked",
            ]);
            for k in &keys {
                t.add_row([
                    k.id.clone(),
                    k.name.clone(),
                    role_name(k.role()).into(),
                    if k.collections.is_empty() {
                        "all".into()
                    } else {
                        k.collections.join(",")
                    },
                    time(k.created_at_ms),
                    time(k.expires_at_ms),
                    time(k.revoked_at_ms),
                ]);
            }
            println!("{t}");
        }
        KeyCmd::Revoke { id } => {
            let k = admin
                .revoke_api_key(RevokeApiKeyRequest { id: id.clone() })
                .await?
                .into_inner()
                .key
                .unwrap_or_default();
            println!("revoked {} ({}) at {}", k.id, k.name, time(k.revoked_at_ms));
        }
    }
    Ok(())
}
