//! Who may call what. API keys look like `rck_<id>_<secret>`: the id finds the record in the
//! replicated catalog, which holds only SHA-256(salt || secret), compared in constant time.
//! Roles nest (reader < writer < admin) and a key may be scoped to collections; the Admin
//! service (cluster operations, keys) needs an admin key without scope. A bootstrap admin key
//! comes from a file (`auth.admin_key_file`, a mounted secret) so the first keys can be made.
//!
//! Admission control lives here too: a process-wide and a per-key bound on requests in
//! flight; beyond either, calls are refused with RESOURCE_EXHAUSTED and a retry hint instead
//! of queueing without bound.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use ragcluster_proto::v1::{
    ApiKeyInfo, ApiKeyRecord, CreateApiKeyRequest, CreateApiKeyResponse, Role,
};

use sha2::{Digest, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::metadata::MetadataMap;

use ragcluster_common::names::role_name;

use crate::catalog::Catalog;
use crate::config::AuthConfig;
use crate::error::{CoordError, Result};

pub const KEY_PREFIX: &str = "rck_";
/// Length of the hex id and the hex secret of generated keys.
const ID_HEX: usize = 16;
const SECRET_HEX: usize = 48;
/// Shortest bootstrap key accepted (the file is a secret; make it long).
const MIN_BOOTSTRAP_KEY: usize = 32;

/// Who is calling, after authentication.
#[derive(Debug, Clone)]
pub struct Caller {
    /// Key id ("bootstrap" for the bootstrap key, "anonymous" with auth off).
    pub id: String,
    pub role: Role,
    /// Collections the key may touch; empty = all.
    pub collections: Vec<String>,
    /// The key as presented, passed on when this coordinator forwards the call.
    pub presented: Option<String>,
}

impl Caller {
    fn anonymous() -> Self {
        Self {
            id: "anonymous".into(),
            role: Role::Admin,
            collections: Vec::new(),
            presented: None,
        }
    }

    /// Whether the key may touch collection `name`.
    pub fn may_see(&self, name: &str) -> bool {
        self.collections.is_empty() || self.collections.iter().any(|c| c == name)
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn hash(salt: &[u8], secret: &str) -> Vec<u8> {
    let mut h = Sha256::new();
    h.update(salt);
    h.update(secret.as_bytes());
    h.finalize().to_vec()
}

/// Equality whose time does not depend on where the inputs differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn random_hex(n: usize) -> String {
    use rand::RngCore;
    let mut b = vec![0u8; n.div_ceil(2)];
    // ThreadRng is a CSPRNG seeded from the OS.
    rand::rng().fill_bytes(&mut b);
    let mut s: String = b.iter().map(|x| format!("{x:02x}")).collect();
    s.truncate(n);
    s
}

/// Splits `rck_<id>_<secret>`.
pub fn split_key(key: &str) -> Option<(&str, &str)> {
    let rest = key.strip_prefix(KEY_PREFIX)?;
    let (id, secret) = rest.split_once('_')?;
    (!id.is_empty() && !secret.is_empty()).then_some((id, secret))
}

/// A fresh key: its record for the catalog (hash only) and the whole key (shown once).
pub fn new_key(
    name: &str,
    role: Role,
    collections: Vec<String>,
    ttl_ms: u64,
) -> (ApiKeyRecord, String) {
    let id = random_hex(ID_HEX);
    let secret = random_hex(SECRET_HEX);
    let salt = random_hex(32).into_bytes();
    let created = now_ms();
    let rec = ApiKeyRecord {
        info: Some(ApiKeyInfo {
            id: id.clone(),
            name: name.to_owned(),
            role: role as i32,
            collections,
            created_at_ms: created,
            expires_at_ms: if ttl_ms == 0 { 0 } else { created + ttl_ms },
            revoked_at_ms: 0,
        }),
        hash: hash(&salt, &secret),
        salt,
    };
    (rec, format!("{KEY_PREFIX}{id}_{secret}"))
}

/// Checks a presented key against the records; the error says why it was refused without
/// telling a guesser which part was wrong beyond "unknown" vs "expired/revoked".
pub fn verify(rec: Option<&ApiKeyRecord>, key: &str, now_ms: u64) -> Result<Caller> {
    let bad = || CoordError::Unauthenticated("invalid API key".into());
    let (id, secret) = split_key(key).ok_or_else(bad)?;
    let rec = rec.ok_or_else(bad)?;
    let info = rec.info.as_ref().ok_or_else(bad)?;
    if info.id != id || !constant_time_eq(&hash(&rec.salt, secret), &rec.hash) {
        return Err(bad());
    }
    if info.revoked_at_ms != 0 {
        return Err(CoordError::Unauthenticated(format!(
            "API key {id} was revoked"
        )));
    }
    if info.expires_at_ms != 0 && now_ms >= info.expires_at_ms {
        return Err(CoordError::Unauthenticated(format!(
            "API key {id} has expired"
        )));
    }
    Ok(Caller {
        id: id.to_owned(),
        role: Role::try_from(info.role).unwrap_or(Role::Unspecified),
        collections: info.collections.clone(),
        presented: Some(key.to_owned()),
    })
}

/// Authentication and admission for one coordinator.
pub struct Auth {
    enabled: bool,
    /// SHA-256 of the bootstrap admin key.
    bootstrap: Option<Vec<u8>>,
    global: Arc<Semaphore>,
    per_key_limit: usize,
    per_key: Mutex<HashMap<String, Arc<Semaphore>>>,
}

/// Held while a request runs; releases its admission slots when dropped.
pub struct Permit {
    _global: OwnedSemaphorePermit,
    _key: OwnedSemaphorePermit,
}

impl Auth {
    pub fn new(cfg: &AuthConfig, max_concurrent: usize, per_key: usize) -> Result<Self> {
        let bootstrap = match (&cfg.admin_key_file, cfg.enabled) {
            (Some(p), _) => {
                let k = std::fs::read_to_string(p).map_err(|e| {
                    CoordError::invalid("auth.admin_key_file", format!("{}: {e}", p.display()))
                })?;
                let k = k.trim();
                if k.len() < MIN_BOOTSTRAP_KEY || !k.bytes().all(|b| b.is_ascii_graphic()) {
                    return Err(CoordError::invalid(
                        "auth.admin_key_file",
                        format!(
                            "{}: the key must be one line of at least {MIN_BOOTSTRAP_KEY} \
                             printable ASCII characters",
                            p.display()
                        ),
                    ));
                }
                Some(hash(b"", k))
            }
            (None, true) => {
                return Err(CoordError::invalid(
                    "auth.admin_key_file",
                    "is needed when auth.enabled (it holds the bootstrap admin key)",
                ));
            }
            (None, false) => None,
        };
        Ok(Self {
            enabled: cfg.enabled,
            bootstrap,
            global: Arc::new(Semaphore::new(max_concurrent)),
            per_key_limit: per_key,
            per_key: Mutex::new(HashMap::new()),
        })
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Who presented `md`'s credentials (an anonymous admin when auth is off).
    pub fn authenticate(&self, md: &MetadataMap, catalog: &Catalog) -> Result<Caller> {
        if !self.enabled {
            return Ok(Caller::anonymous());
        }
        let key = ragcluster_common::client::api_key(md)
            .filter(|k| !k.is_empty())
            .ok_or_else(|| {
                CoordError::Unauthenticated(
                    "missing API key: send metadata \"authorization: Bearer <key>\"".into(),
                )
            })?;
        if let Some(b) = &self.bootstrap
            && constant_time_eq(&hash(b"", key), b)
        {
            return Ok(Caller {
                id: "bootstrap".into(),
                role: Role::Admin,
                collections: Vec::new(),
                presented: Some(key.to_owned()),
            });
        }
        let id = split_key(key).map(|(id, _)| id).unwrap_or_default();
        verify(catalog.api_key(id).as_ref(), key, now_ms())
    }

    /// Authenticates and checks that the caller has `need` on `collection` (`None`: a cluster
    /// operation, which also needs an unscoped key).
    pub fn authorize(
        &self,
        md: &MetadataMap,
        catalog: &Catalog,
        what: &str,
        need: Role,
        collection: Option<&str>,
    ) -> Result<Caller> {
        let c = self.authenticate(md, catalog)?;
        // A key scoped to a collection may use it through its aliases too.
        match collection
            .filter(|n| !c.may_see(n))
            .and_then(|n| catalog.alias_target(n))
        {
            Some(target) => check(&c, what, need, Some(&target))?,
            None => check(&c, what, need, collection)?,
        }
        Ok(c)
    }

    /// Takes an admission slot for the caller, or refuses at once.
    pub fn admit(&self, caller: &Caller) -> Result<Permit> {
        let overloaded = |reason: String| {
            metrics::counter!("coordinator_requests_shed_total").increment(1);
            CoordError::Overloaded {
                reason,
                retry_after_ms: 100,
            }
        };
        let global =
            self.global.clone().try_acquire_owned().map_err(|_| {
                overloaded("too many requests in flight on this coordinator".into())
            })?;
        let sem = self
            .per_key
            .lock()
            .entry(caller.id.clone())
            .or_insert_with(|| Arc::new(Semaphore::new(self.per_key_limit)))
            .clone();
        let key = sem.try_acquire_owned().map_err(|_| {
            overloaded(format!(
                "API key {} has {} requests in flight, the most allowed \
                 (limits.max_concurrent_requests_per_key)",
                caller.id, self.per_key_limit
            ))
        })?;
        Ok(Permit {
            _global: global,
            _key: key,
        })
    }
}

/// Checks a key request and makes the key (on the catalog leader: the gRPC edge forwards
/// there). Returns its info and its secret, which is shown only here.
pub async fn create_key(
    catalog: &Catalog,
    r: CreateApiKeyRequest,
    caller: &Caller,
) -> Result<CreateApiKeyResponse> {
    let name = r.name.trim().to_owned();
    if name.is_empty() || name.len() > 128 || name.chars().any(char::is_control) {
        return Err(CoordError::invalid(
            "name",
            "must be 1 to 128 characters without control characters",
        ));
    }
    let role = match Role::try_from(r.role) {
        Ok(Role::Unspecified) | Err(_) => {
            return Err(CoordError::invalid(
                "role",
                "must be reader, writer or admin",
            ));
        }
        Ok(role) => role,
    };
    if r.collections.len() > 256 {
        return Err(CoordError::invalid("collections", "at most 256"));
    }
    if let Some(c) = r
        .collections
        .iter()
        .find(|c| !crate::catalog::valid_name(c))
    {
        return Err(CoordError::invalid(
            "collections",
            format!("{c:?} is not a valid collection name"),
        ));
    }
    if r.ttl_seconds > 100 * 365 * 86_400 {
        return Err(CoordError::invalid("ttl_seconds", "at most 100 years"));
    }
    let (rec, secret) = new_key(&name, role, r.collections, r.ttl_seconds * 1000);
    let info = rec.info.clone();
    catalog.add_api_key(rec, KEY_TIMEOUT).await?;
    tracing::info!(
        by = caller.id,
        key = info.as_ref().map(|i| i.id.as_str()),
        role = role_name(role),
        "API key created"
    );
    Ok(CreateApiKeyResponse { key: info, secret })
}

/// Revokes a key (on the catalog leader).
pub async fn revoke_key(catalog: &Catalog, id: &str, caller: &Caller) -> Result<()> {
    if catalog.api_key(id).is_none() {
        return Err(CoordError::UnknownApiKey(id.to_owned()));
    }
    catalog.revoke_api_key(id, now_ms(), KEY_TIMEOUT).await?;
    tracing::info!(by = caller.id, key = id, "API key revoked");
    Ok(())
}

const KEY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The role and scope rule.
pub fn check(c: &Caller, what: &str, need: Role, collection: Option<&str>) -> Result<()> {
    if (c.role as i32) < (need as i32) {
        return Err(CoordError::PermissionDenied(format!(
            "{what} needs role {}; API key {} has role {}",
            role_name(need),
            c.id,
            role_name(c.role)
        )));
    }
    match collection {
        Some(name) if !c.may_see(name) => Err(CoordError::PermissionDenied(format!(
            "API key {} may not access collection {name:?}",
            c.id
        ))),
        None if !c.collections.is_empty() => Err(CoordError::PermissionDenied(format!(
            "{what} is a cluster operation; API key {} is scoped to collections",
            c.id
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_verify_only_with_their_secret_and_while_valid() {
        let (rec, key) = new_key("ci", Role::Writer, vec!["docs".into()], 0);
        assert!(key.starts_with("rck_"));
        assert_ne!(rec.hash, key.as_bytes(), "the secret is never stored");
        let c = verify(Some(&rec), &key, now_ms()).unwrap();
        assert_eq!(c.role, Role::Writer);
        let mut forged = key.clone();
        forged.pop();
        forged.push(if key.ends_with('0') { '1' } else { '0' });
        assert!(matches!(
            verify(Some(&rec), &forged, now_ms()),
            Err(CoordError::Unauthenticated(_))
        ));
        assert!(verify(None, &key, now_ms()).is_err());
        let mut revoked = rec.clone();
        revoked.info.as_mut().unwrap().revoked_at_ms = 1;
        assert!(
            verify(Some(&revoked), &key, now_ms())
                .unwrap_err()
                .to_string()
                .contains("revoked")
        );
        let (rec, key) = new_key("tmp", Role::Reader, vec![], 1000);
        let later = rec.info.as_ref().unwrap().expires_at_ms;
        assert!(verify(Some(&rec), &key, later - 1).is_ok());
        assert!(
            verify(Some(&rec), &key, later)
                .unwrap_err()
                .to_string()
                .contains("expired")
        );
    }

    #[test]
    fn roles_nest_and_scopes_bind() {
        let c = |role, cols: &[&str]| Caller {
            id: "k".into(),
            role,
            collections: cols.iter().map(|s| s.to_string()).collect(),
            presented: None,
        };
        let reader = c(Role::Reader, &["a"]);
        assert!(check(&reader, "Search", Role::Reader, Some("a")).is_ok());
        assert!(check(&reader, "Search", Role::Reader, Some("b")).is_err());
        assert!(check(&reader, "Upsert", Role::Writer, Some("a")).is_err());
        let admin = c(Role::Admin, &["a"]);
        assert!(check(&admin, "Upsert", Role::Writer, Some("a")).is_ok());
        assert!(check(&admin, "ClusterStatus", Role::Admin, None).is_err());
        assert!(check(&c(Role::Admin, &[]), "ClusterStatus", Role::Admin, None).is_ok());
        assert!(check(&c(Role::Writer, &[]), "ClusterStatus", Role::Admin, None).is_err());
    }

    #[test]
    fn admission_is_bounded_per_key_and_overall() {
        let a = Auth::new(&AuthConfig::default(), 3, 2).unwrap();
        let k1 = Caller::anonymous();
        let mut k2 = Caller::anonymous();
        k2.id = "other".into();
        let p1 = a.admit(&k1).unwrap();
        let _p2 = a.admit(&k1).unwrap();
        assert!(matches!(a.admit(&k1), Err(CoordError::Overloaded { .. })));
        let _p3 = a.admit(&k2).unwrap();
        assert!(a.admit(&k2).is_err(), "the process-wide bound holds too");
        drop(p1);
        assert!(a.admit(&k1).is_ok());
    }
}
