//! Security on a real cluster on loopback, with mutual TLS between every process (certificates
//! from `scripts/dev-certs.sh`) and API keys on the coordinator:
//! - every Coordinator and Admin RPC is tried with no key, a revoked key, an expired key, a
//!   key whose role is too low and a key scoped to another collection: each is refused with
//!   UNAUTHENTICATED or PERMISSION_DENIED, and afterwards nothing has changed (documents,
//!   collections, keys, placement);
//! - internal services (Shard, ModelWorker, CatalogPeer) refuse callers without a member
//!   certificate of the cluster CA; plaintext clients against TLS ports fail cleanly;
//! - the coordinator's Unix socket (plaintext, for clients on the host) takes the same API
//!   keys: without one every RPC is refused, and CatalogPeer refuses even the admin there;
//! - rotating the CA and certificates on disk takes effect without restarts.
//!
//! Overload (the per-key concurrency limit) is `overload.rs`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use ragcluster_common::client::KeyedChannel;
use ragcluster_common::tls::{ClientAuth, Tls, TlsConfig};
use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::catalog_peer_client::CatalogPeerClient;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::membership_client::MembershipClient;
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragcluster_proto::v1::shard_client::ShardClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::{Cluster, Options, ingest_sample, workspace};
use tonic::Code;

/// Runs the dev-CA script into `dir`.
fn make_certs(dir: &Path) -> Result<()> {
    let out = std::process::Command::new("bash")
        .arg(workspace().join("scripts/dev-certs.sh"))
        .arg(dir)
        .output()?;
    ensure!(
        out.status.success(),
        "dev-certs.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Client TLS: trusts `ca`, presents `member` (cert, key) when given.
fn client_tls(ca: &Path, member: Option<&Path>) -> Result<Arc<Tls>> {
    let cfg = TlsConfig {
        ca_file: Some(ca.to_owned()),
        cert_file: member.map(|d| d.join("member.pem")),
        key_file: member.map(|d| d.join("member.key")),
        ..TlsConfig::with_client_auth(ClientAuth::Required)
    };
    Tls::load(&cfg)?.context("client tls")
}

fn lazy(addr: &str, tls: Option<&Arc<Tls>>, key: Option<&str>) -> Result<KeyedChannel> {
    let ch = ragcluster_common::tls::lazy_channel(addr, tls, |e| {
        e.connect_timeout(Duration::from_secs(3))
            .timeout(Duration::from_secs(10))
    })?;
    Ok(KeyedChannel::new(ch, key)?)
}

fn secure_config(certs: &Path, extra_coordinator: &str) -> String {
    let d = certs.display();
    let tls = |auth: &str| {
        format!(
            "cert_file = \"{d}/member.pem\"\nkey_file = \"{d}/member.key\"\n\
             ca_file = \"{d}/ca.pem\"\nclient_auth = \"{auth}\"\nreload_interval = \"200ms\"\n"
        )
    };
    format!(
        "[coordinator]\n{extra_coordinator}\n[coordinator.auth]\nenabled = true\n\
         admin_key_file = \"{d}/admin.key\"\n\n[coordinator.tls]\n{}\n\
         [shard_node.tls]\n{}\n[model_worker.tls]\n{}",
        tls("optional"),
        tls("required"),
        tls("required")
    )
}

fn code<T>(r: &std::result::Result<T, tonic::Status>) -> Code {
    match r {
        Ok(_) => Code::Ok,
        Err(s) => s.code(),
    }
}

/// Every Coordinator and Admin RPC once, but those in `skip` (allowed to this caller: an
/// allowed Upsert would change what is compared), with requests that would change things if
/// they were allowed.
async fn try_every_rpc(
    ch: KeyedChannel,
    shard_nodes: &[String],
    victim_key: &str,
    skip: &[&str],
) -> BTreeMap<&'static str, Code> {
    let mut c = CoordinatorClient::new(ch.clone());
    let mut a = AdminClient::new(ch);
    let mut out = BTreeMap::new();
    macro_rules! attempt {
        ($name:literal, $call:expr) => {
            if !skip.contains(&$name) {
                out.insert($name, code(&$call.await));
            }
        };
    }
    let sec = || "sec".to_string();
    attempt!(
        "CreateCollection",
        c.create_collection(CreateCollectionRequest {
            name: "evil".into(),
            shard_count: 1,
            ..Default::default()
        })
    );
    attempt!(
        "DropCollection",
        c.drop_collection(DropCollectionRequest { name: sec() })
    );
    attempt!(
        "ListCollections",
        c.list_collections(ListCollectionsRequest {})
    );
    attempt!(
        "DescribeCollection",
        c.describe_collection(DescribeCollectionRequest { name: sec() })
    );
    attempt!(
        "UpsertDocuments",
        c.upsert_documents(UpsertDocumentsRequest {
            collection: sec(),
            documents: vec![Document {
                id: "evil.md".into(),
                text: "planted text".into(),
                ..Default::default()
            }],
            ..Default::default()
        })
    );
    attempt!(
        "DeleteDocuments",
        c.delete_documents(DeleteDocumentsRequest {
            collection: sec(),
            ids: vec!["raft-consensus.md".into()],
            ..Default::default()
        })
    );
    attempt!(
        "UpdateDocuments",
        c.update_documents(UpdateDocumentsRequest {
            collection: sec(),
            ids: vec!["raft-consensus.md".into()],
            patch: Some(MetadataPatch {
                set_metadata: [("evil".to_owned(), "yes".to_owned())].into(),
                ..Default::default()
            }),
            ..Default::default()
        })
    );
    attempt!(
        "Search",
        c.search(SearchRequest {
            collection: sec(),
            query: "raft leader".into(),
            top_k: 3,
            ..Default::default()
        })
    );
    attempt!(
        "GetDocuments",
        c.get_documents(GetDocumentsRequest {
            collection: sec(),
            ids: vec!["raft-consensus.md".into()],
            ..Default::default()
        })
    );
    attempt!(
        "Scroll",
        c.scroll(ScrollRequest {
            collection: sec(),
            ..Default::default()
        })
    );
    attempt!(
        "Count",
        c.count(CountRequest {
            collection: sec(),
            ..Default::default()
        })
    );
    attempt!(
        "Ask",
        c.ask(AskRequest {
            collection: sec(),
            question: "What is Raft?".into(),
            ..Default::default()
        })
    );
    attempt!(
        "UpdateAliases",
        c.update_aliases(UpdateAliasesRequest {
            actions: vec![AliasAction {
                action: Some(alias_action::Action::Put(Alias {
                    alias: "evil".into(),
                    collection: sec(),
                })),
            }],
        })
    );
    attempt!("ListAliases", c.list_aliases(ListAliasesRequest::default()));
    attempt!(
        "AddFields",
        c.add_fields(AddFieldsRequest {
            collection: sec(),
            fields: vec![FieldSchema {
                name: "evil".into(),
                r#type: FieldType::Keyword as i32,
            }],
        })
    );
    attempt!("ClusterStatus", a.cluster_status(ClusterStatusRequest {}));
    attempt!(
        "MoveReplica",
        a.move_replica(MoveReplicaRequest {
            collection: sec(),
            shard: 0,
            from: shard_nodes[0].clone(),
            to: shard_nodes[1].clone(),
        })
    );
    attempt!(
        "TransferShardLeader",
        a.transfer_shard_leader(TransferShardLeaderRequest {
            collection: sec(),
            shard: 0,
            to: shard_nodes[1].clone(),
        })
    );
    attempt!(
        "CreateApiKey",
        a.create_api_key(CreateApiKeyRequest {
            name: "evil".into(),
            role: Role::Admin as i32,
            ..Default::default()
        })
    );
    attempt!("ListApiKeys", a.list_api_keys(ListApiKeysRequest {}));
    attempt!(
        "RevokeApiKey",
        a.revoke_api_key(RevokeApiKeyRequest {
            id: victim_key.to_owned(),
        })
    );
    attempt!(
        "SetNodeState",
        a.set_node_state(SetNodeStateRequest {
            node_id: 424_242,
            state: MemberState::Draining as i32,
        })
    );
    attempt!(
        "RemoveNode",
        a.remove_node(RemoveNodeRequest { node_id: 424_242 })
    );
    attempt!(
        "BackupShard",
        a.backup_shard(BackupShardRequest {
            collection: sec(),
            shard: 0,
        })
    );
    attempt!(
        "RestoreDocuments",
        a.restore_documents(RestoreDocumentsRequest {
            collection: sec(),
            documents: vec![DocumentWrite {
                doc_id: "evil".into(),
                chunks: vec![Chunk {
                    chunk_id: "evil#0".into(),
                    doc_id: "evil".into(),
                    text: "evil".into(),
                    embedding: vec![0.1; 384],
                    ..Default::default()
                }],
                delete: false,
            }],
        })
    );
    attempt!(
        "Reembed",
        a.reembed(ReembedRequest {
            collection: sec(),
            action: ReembedAction::Start as i32,
            embedding_model: "all-minilm-l6-v2".into(),
            target: "evil".into(),
            ..Default::default()
        })
    );
    out
}

const ADMIN_RPCS: [&str; 11] = [
    "ClusterStatus",
    "MoveReplica",
    "TransferShardLeader",
    "CreateApiKey",
    "ListApiKeys",
    "RevokeApiKey",
    "SetNodeState",
    "RemoveNode",
    "BackupShard",
    "RestoreDocuments",
    "Reembed",
];

/// What must stay the same whatever refused callers tried.
#[derive(Debug, PartialEq)]
struct Snapshot {
    collections: Vec<String>,
    documents: u64,
    chunks: u64,
    keys: Vec<(String, u64)>,
    placement: Vec<Vec<String>>,
    hits: Vec<String>,
    aliases: usize,
}

async fn snapshot(admin: &KeyedChannel) -> Result<Snapshot> {
    let mut c = CoordinatorClient::new(admin.clone());
    let mut a = AdminClient::new(admin.clone());
    let mut collections: Vec<String> = c
        .list_collections(ListCollectionsRequest {})
        .await?
        .into_inner()
        .collections
        .into_iter()
        .map(|c| c.name)
        .collect();
    collections.sort();
    let d = c
        .describe_collection(DescribeCollectionRequest { name: "sec".into() })
        .await?
        .into_inner();
    let (documents, chunks) = d
        .shards
        .iter()
        .fold((0, 0), |(a, b), s| (a + s.documents, b + s.chunks));
    let mut keys: Vec<(String, u64)> = a
        .list_api_keys(ListApiKeysRequest {})
        .await?
        .into_inner()
        .keys
        .into_iter()
        .map(|k| (k.id, k.revoked_at_ms))
        .collect();
    keys.sort();
    let placement = d
        .collection
        .unwrap_or_default()
        .shards
        .into_iter()
        .map(|p| p.nodes)
        .collect();
    let hits = c
        .search(SearchRequest {
            collection: "sec".into(),
            query: "planted text raft leader election".into(),
            top_k: 5,
            mode: SearchMode::Bm25 as i32,
            ..Default::default()
        })
        .await?
        .into_inner()
        .hits
        .into_iter()
        .map(|h| h.doc_id)
        .collect();
    let aliases = c
        .list_aliases(ListAliasesRequest::default())
        .await?
        .into_inner()
        .aliases
        .len();
    Ok(Snapshot {
        collections,
        documents,
        chunks,
        keys,
        placement,
        hits,
        aliases,
    })
}

async fn new_key(
    admin: &KeyedChannel,
    name: &str,
    role: Role,
    collections: &[&str],
    ttl_seconds: u64,
) -> Result<(String, String)> {
    let r = AdminClient::new(admin.clone())
        .create_api_key(CreateApiKeyRequest {
            name: name.into(),
            role: role as i32,
            collections: collections.iter().map(|s| s.to_string()).collect(),
            ttl_seconds,
        })
        .await?
        .into_inner();
    Ok((r.key.unwrap_or_default().id, r.secret))
}

/// Whether a call on a fresh connection fails within 10 s (instead of hanging or passing).
async fn refused<T>(
    what: &str,
    fut: impl std::future::Future<Output = std::result::Result<T, tonic::Status>>,
) -> Result<Code> {
    let started = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .with_context(|| format!("{what}: no answer in 10 s"))?;
    match r {
        Ok(_) => anyhow::bail!("{what}: accepted"),
        Err(s) => {
            eprintln!(
                "{what}: refused with {:?} in {} ms ({})",
                s.code(),
                started.elapsed().as_millis(),
                s.message()
            );
            Ok(s.code())
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tls_and_api_keys_refuse_every_rpc_without_side_effects() -> Result<()> {
    let certs_dir = tempfile::tempdir()?;
    let certs = certs_dir.path().join("cluster");
    let rogue = certs_dir.path().join("rogue");
    make_certs(&certs)?;
    make_certs(&rogue)?;
    // The coordinator also serves a Unix socket: no TLS there, API keys all the same.
    let sock = certs_dir.path().join("coordinator.sock");
    let config = secure_config(&certs, &format!("unix_socket = \"{}\"", sock.display()));
    let cluster = Cluster::start_opts(Options {
        shard_nodes: 2,
        shard_config: Some(&config),
        coordinators: 1,
        coordinator_config: Some(&config),
        model_worker_config: Some(&config),
        ..Default::default()
    })?;
    let co = cluster.coordinator.grpc.clone();
    ensure!(co.starts_with("https://"), "coordinator serves TLS: {co}");
    let shard_nodes: Vec<String> = cluster.shards.iter().map(|s| s.grpc.clone()).collect();
    let admin_key = std::fs::read_to_string(certs.join("admin.key"))?
        .trim()
        .to_owned();
    // Clients need only the CA (and a key); member certificates are for the cluster.
    let ca_only = client_tls(&certs.join("ca.pem"), None)?;
    let admin = lazy(&co, Some(&ca_only), Some(&admin_key))?;
    ingest_sample(&mut CoordinatorClient::new(admin.clone()), "sec", 2).await?;
    CoordinatorClient::new(admin.clone())
        .create_collection(CreateCollectionRequest {
            name: "other".into(),
            shard_count: 1,
            ..Default::default()
        })
        .await?;

    let (reader_id, reader) = new_key(&admin, "reader", Role::Reader, &["sec"], 0).await?;
    let (_, writer) = new_key(&admin, "writer", Role::Writer, &["sec"], 0).await?;
    let (_, other_admin) = new_key(&admin, "other-admin", Role::Admin, &["other"], 0).await?;
    let (revoked_id, revoked) = new_key(&admin, "revoked", Role::Admin, &[], 0).await?;
    let (_, expiring) = new_key(&admin, "expiring", Role::Admin, &[], 1).await?;
    // The keys work before they are revoked or expire.
    for k in [&revoked, &expiring] {
        AdminClient::new(lazy(&co, Some(&ca_only), Some(k))?)
            .list_api_keys(ListApiKeysRequest {})
            .await?;
    }
    AdminClient::new(admin.clone())
        .revoke_api_key(RevokeApiKeyRequest {
            id: revoked_id.clone(),
        })
        .await?;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let before = snapshot(&admin).await?;
    ensure!(
        before.documents > 0 && before.hits.iter().all(|h| h != "evil.md"),
        "{before:?}"
    );

    fn every(m: &BTreeMap<&'static str, Code>) -> Vec<&'static str> {
        m.keys().copied().collect()
    }
    let mut refusals = 0;
    for (case, key) in [
        ("no key", None),
        ("revoked key", Some(revoked.as_str())),
        ("expired key", Some(expiring.as_str())),
        ("malformed key", Some("rck_nope")),
        ("bootstrap key with a typo", Some(&admin_key[1..])),
    ] {
        let got = try_every_rpc(
            lazy(&co, Some(&ca_only), key)?,
            &shard_nodes,
            &reader_id,
            &[],
        )
        .await;
        for (rpc, c) in &got {
            ensure!(*c == Code::Unauthenticated, "{case}: {rpc} answered {c:?}");
            refusals += 1;
        }
        ensure!(got.len() == 26, "{case}: {:?}", every(&got));
    }
    // The Unix socket: without a key every RPC is refused, the admin key works, and the
    // catalog's internal service (a member certificate under TLS) refuses even the admin.
    let unix = format!("unix:{}", sock.display());
    let got = try_every_rpc(lazy(&unix, None, None)?, &shard_nodes, &reader_id, &[]).await;
    for (rpc, c) in &got {
        ensure!(
            *c == Code::Unauthenticated,
            "Unix socket, no key: {rpc} answered {c:?}"
        );
        refusals += 1;
    }
    ensure!(got.len() == 26, "Unix socket: {:?}", every(&got));
    CoordinatorClient::new(lazy(&unix, None, Some(&admin_key))?)
        .list_collections(ListCollectionsRequest {})
        .await
        .context("the admin key over the Unix socket")?;
    let c = refused(
        "CatalogPeer over the Unix socket",
        CatalogPeerClient::new(lazy(&unix, None, Some(&admin_key))?).raft(CatalogRaftBatch {
            from_node_id: 1,
            messages: vec![],
        }),
    )
    .await?;
    ensure!(
        c == Code::Unauthenticated,
        "CatalogPeer over the socket answered {c:?}"
    );
    // Roles too low: a reader and a writer of "sec".
    let denied = |got: &BTreeMap<&'static str, Code>, rpcs: &[&str], case: &str| -> Result<()> {
        for rpc in rpcs {
            let c = got.iter().find(|(k, _)| **k == *rpc).map(|(_, c)| *c);
            ensure!(
                c == Some(Code::PermissionDenied),
                "{case}: {rpc} answered {c:?}"
            );
        }
        Ok(())
    };
    let reads = [
        "ListCollections",
        "DescribeCollection",
        "Search",
        "GetDocuments",
        "Scroll",
        "Count",
        "ListAliases",
        "Ask",
    ];
    let got = try_every_rpc(
        lazy(&co, Some(&ca_only), Some(&reader))?,
        &shard_nodes,
        &reader_id,
        &reads,
    )
    .await;
    let mut reader_denied = vec![
        "CreateCollection",
        "DropCollection",
        "UpsertDocuments",
        "DeleteDocuments",
        "UpdateDocuments",
        "AddFields",
        "UpdateAliases",
    ];
    reader_denied.extend(ADMIN_RPCS);
    denied(&got, &reader_denied, "reader")?;
    refusals += reader_denied.len();
    ensure!(got.len() == reader_denied.len(), "{:?}", every(&got));
    let mut writes = reads.to_vec();
    writes.extend([
        "UpsertDocuments",
        "DeleteDocuments",
        "UpdateDocuments",
        "AddFields",
    ]);
    let got = try_every_rpc(
        lazy(&co, Some(&ca_only), Some(&writer))?,
        &shard_nodes,
        &reader_id,
        &writes,
    )
    .await;
    let mut writer_denied = vec!["CreateCollection", "DropCollection", "UpdateAliases"];
    writer_denied.extend(ADMIN_RPCS);
    denied(&got, &writer_denied, "writer")?;
    refusals += writer_denied.len();
    ensure!(got.len() == writer_denied.len(), "{:?}", every(&got));
    // ...and what they may do, they can.
    CoordinatorClient::new(lazy(&co, Some(&ca_only), Some(&reader))?)
        .search(SearchRequest {
            collection: "sec".into(),
            query: "raft".into(),
            top_k: 3,
            ..Default::default()
        })
        .await
        .context("a reader searches its collection")?;
    // An admin of another collection: nothing on "sec", no cluster operations.
    let got = try_every_rpc(
        lazy(&co, Some(&ca_only), Some(&other_admin))?,
        &shard_nodes,
        &reader_id,
        &[],
    )
    .await;
    let scoped: Vec<&str> = every(&got)
        .into_iter()
        .filter(|r| !["ListCollections", "ListAliases"].contains(r))
        .collect();
    denied(&got, &scoped, "admin of another collection")?;
    refusals += scoped.len();
    let visible = CoordinatorClient::new(lazy(&co, Some(&ca_only), Some(&other_admin))?)
        .list_collections(ListCollectionsRequest {})
        .await?
        .into_inner()
        .collections;
    ensure!(
        visible.iter().map(|c| c.name.as_str()).collect::<Vec<_>>() == ["other"],
        "a scoped key lists only its collections"
    );

    let after = snapshot(&admin).await?;
    ensure!(
        before == after,
        "refused calls changed the cluster:\nbefore {before:?}\nafter  {after:?}"
    );
    eprintln!("{refusals} refused calls, no side effect: {after:?}");

    // Internal services take only member certificates of the cluster CA.
    let member = client_tls(&certs.join("ca.pem"), Some(&certs))?;
    let rogue_member = client_tls(&certs.join("ca.pem"), Some(&rogue))?;
    let shard = &shard_nodes[0];
    let plain = shard.replace("https://", "http://");
    for (what, ch) in [
        ("shard node, plaintext", lazy(&plain, None, None)?),
        (
            "shard node, TLS without certificate",
            lazy(shard, Some(&ca_only), None)?,
        ),
        (
            "shard node, certificate of another CA",
            lazy(shard, Some(&rogue_member), None)?,
        ),
        (
            "shard node, with the admin API key",
            lazy(shard, Some(&ca_only), Some(&admin_key))?,
        ),
    ] {
        let mut s = ShardClient::new(ch);
        refused(what, s.node_info(NodeInfoRequest {})).await?;
        refused(
            what,
            s.drop_shard(DropShardRequest {
                shard: Some(ShardRef {
                    collection: "sec".into(),
                    shard: 0,
                }),
            }),
        )
        .await?;
    }
    ShardClient::new(lazy(shard, Some(&member), None)?)
        .node_info(NodeInfoRequest {})
        .await
        .context("a member certificate gets through")?;
    let mw = &cluster.model_worker.grpc;
    for (what, ch) in [
        (
            "model worker, plaintext",
            lazy(&mw.replace("https://", "http://"), None, None)?,
        ),
        (
            "model worker, TLS without certificate",
            lazy(mw, Some(&ca_only), None)?,
        ),
        (
            "model worker, certificate of another CA",
            lazy(mw, Some(&rogue_member), None)?,
        ),
    ] {
        refused(
            what,
            ModelWorkerClient::new(ch).embed(EmbedRequest {
                texts: vec!["hello".into()],
                ..Default::default()
            }),
        )
        .await?;
    }
    ModelWorkerClient::new(lazy(mw, Some(&member), None)?)
        .list_models(ListModelsRequest {})
        .await?;
    let raft = |ch: KeyedChannel| async move {
        CatalogPeerClient::new(ch)
            .raft(CatalogRaftBatch {
                from_node_id: 1,
                messages: vec![],
            })
            .await
    };
    let c = refused(
        "CatalogPeer without member certificate",
        raft(lazy(&co, Some(&ca_only), Some(&admin_key))?),
    )
    .await?;
    ensure!(c == Code::Unauthenticated, "CatalogPeer answered {c:?}");
    raft(lazy(&co, Some(&member), None)?).await?;
    // Joining the cluster takes a member certificate too.
    let beat = |ch: KeyedChannel| async move {
        MembershipClient::new(ch)
            .heartbeat(HeartbeatRequest {
                node_id: 99,
                kind: NodeKind::ShardNode as i32,
                address: "https://127.0.0.1:1".into(),
                ..Default::default()
            })
            .await
    };
    let c = refused(
        "Membership without member certificate",
        beat(lazy(&co, Some(&ca_only), Some(&admin_key))?),
    )
    .await?;
    ensure!(c == Code::Unauthenticated, "Membership answered {c:?}");
    refused(
        "coordinator, plaintext client",
        CoordinatorClient::new(lazy(
            &co.replace("https://", "http://"),
            None,
            Some(&admin_key),
        )?)
        .list_collections(ListCollectionsRequest {}),
    )
    .await?;
    refused(
        "coordinator, client that trusts another CA",
        CoordinatorClient::new(lazy(
            &co,
            Some(&client_tls(&rogue.join("ca.pem"), None)?),
            Some(&admin_key),
        )?)
        .list_collections(ListCollectionsRequest {}),
    )
    .await?;
    ensure!(
        snapshot(&admin).await? == after,
        "internal refusals changed nothing"
    );

    // Rotation: a new CA and certificates on disk; the processes reload them within
    // reload_interval, with no restart.
    let old_ca = certs_dir.path().join("old-ca.pem");
    std::fs::copy(certs.join("ca.pem"), &old_ca)?;
    std::fs::remove_file(certs.join("ca.pem"))?;
    std::fs::remove_file(certs.join("ca.key"))?;
    make_certs(&certs)?;
    let new_ca = client_tls(&certs.join("ca.pem"), None)?;
    let started = Instant::now();
    loop {
        let r = CoordinatorClient::new(lazy(&co, Some(&new_ca), Some(&admin_key))?)
            .list_collections(ListCollectionsRequest {})
            .await;
        if r.is_ok() {
            break;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(10),
            "the coordinator did not reload its certificates: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "certificates reloaded within {} ms",
        started.elapsed().as_millis()
    );
    let old = client_tls(&old_ca, None)?;
    refused(
        "coordinator after rotation, client trusting the old CA",
        CoordinatorClient::new(lazy(&co, Some(&old), Some(&admin_key))?)
            .list_collections(ListCollectionsRequest {}),
    )
    .await?;
    // New member connections use the new certificates (the shard node reloaded too).
    let new_member = client_tls(&certs.join("ca.pem"), Some(&certs))?;
    let started = Instant::now();
    while ShardClient::new(lazy(shard, Some(&new_member), None)?)
        .node_info(NodeInfoRequest {})
        .await
        .is_err()
    {
        ensure!(
            started.elapsed() < Duration::from_secs(10),
            "shard node did not reload"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let admin = lazy(&co, Some(&new_ca), Some(&admin_key))?;
    ensure!(
        snapshot(&admin).await? == after,
        "the cluster serves as before"
    );
    Ok(())
}
