//! The public `Coordinator` service.

use std::sync::Arc;
use std::time::Duration;

use ragcluster_proto::v1::coordinator_server::Coordinator;
use ragcluster_proto::v1::*;
use tonic::{Request, Response, Status};

use super::forward::{Forwarder, is_forwarded};
use super::{Admitted, convert, gate, tighter_timeout};
use crate::auth::{Caller, check};
use crate::collections::{Collections, check_alias_actions};
use crate::documents::Documents;
use crate::flow::Engine;
use crate::handles::Handles;
use crate::ingest::{Ingestor, check_collection};
use crate::limits::{MAX_ASK_TIMEOUT_MS, MAX_SEARCH_TIMEOUT_MS};
use crate::search::Searcher;

/// How long a coordinator that forwarded a catalog change waits to see it applied locally.
const CATCH_UP: Duration = Duration::from_secs(5);

pub struct CoordinatorService {
    pub handles: Arc<Handles>,
    pub collections: Arc<Collections>,
    pub ingestor: Arc<Ingestor>,
    pub searcher: Arc<Searcher>,
    /// GetDocuments, Scroll and Count.
    pub documents: Arc<Documents>,
    pub engine: Arc<Engine>,
    pub forward: Arc<Forwarder>,
    /// Deadline of a search that gives none.
    pub search_timeout: Duration,
    /// `limits.max_top_k`.
    pub max_top_k: u32,
}

#[tonic::async_trait]
impl Coordinator for CoordinatorService {
    async fn create_collection(
        &self,
        req: Request<CreateCollectionRequest>,
    ) -> Result<Response<CreateCollectionResponse>, Status> {
        let h = &self.handles;
        let name = req.get_ref().name.clone();
        let (caller, _p) = gate(h, &req, "CreateCollection", Role::Admin, Some(&name))?;
        let target = h
            .catalog
            .change_target(is_forwarded(req.metadata()))
            .await?;
        let r = req.into_inner();
        let collection = match target {
            None => self.collections.create(r).await?,
            Some(leader) => {
                let info = self.forward.create_collection(&leader, r, &caller).await?;
                h.catalog
                    .wait_for(|v| v.collections.contains_key(&name), CATCH_UP)
                    .await;
                info
            }
        };
        Ok(Response::new(CreateCollectionResponse {
            collection: Some(collection),
        }))
    }

    async fn drop_collection(
        &self,
        req: Request<DropCollectionRequest>,
    ) -> Result<Response<DropCollectionResponse>, Status> {
        let h = &self.handles;
        let name = req.get_ref().name.clone();
        let (caller, _p) = gate(h, &req, "DropCollection", Role::Admin, Some(&name))?;
        check_collection("name", &name)?;
        match h
            .catalog
            .change_target(is_forwarded(req.metadata()))
            .await?
        {
            None => self.collections.remove(&name).await?,
            Some(leader) => {
                self.forward
                    .drop_collection(&leader, &name, &caller)
                    .await?;
                h.catalog
                    .wait_for(|v| !v.collections.contains_key(&name), CATCH_UP)
                    .await;
            }
        }
        Ok(Response::new(DropCollectionResponse {}))
    }

    async fn list_collections(
        &self,
        req: Request<ListCollectionsRequest>,
    ) -> Result<Response<ListCollectionsResponse>, Status> {
        let h = &self.handles;
        let (caller, _p) = list_gate(h, &req, "ListCollections")?;
        let mut collections = h.catalog.list();
        collections.retain(|c| caller.may_see(&c.name));
        Ok(Response::new(ListCollectionsResponse { collections }))
    }

    async fn describe_collection(
        &self,
        req: Request<DescribeCollectionRequest>,
    ) -> Result<Response<DescribeCollectionResponse>, Status> {
        let name = req.get_ref().name.clone();
        let _g = gate(
            &self.handles,
            &req,
            "DescribeCollection",
            Role::Reader,
            Some(&name),
        )?;
        check_collection("name", &name)?;
        let info = self.handles.catalog.get(&name)?;
        let shards = self.collections.stats(&info).await;
        Ok(Response::new(DescribeCollectionResponse {
            collection: Some(info),
            shards,
        }))
    }

    async fn upsert_documents(
        &self,
        req: Request<UpsertDocumentsRequest>,
    ) -> Result<Response<UpsertDocumentsResponse>, Status> {
        let coll = req.get_ref().collection.clone();
        let (caller, _p) = gate(
            &self.handles,
            &req,
            "UpsertDocuments",
            Role::Writer,
            Some(&coll),
        )?;
        let client = ragcluster_common::server::grpc_timeout(req.metadata());
        let forwarded = is_forwarded(req.metadata());
        let r = req.into_inner();
        // Fields new to the collection join its schema first (all checked before anything
        // changes); the write then finds them there.
        check_collection("collection", &r.collection)?;
        let (info, _) = self.handles.catalog.write_route(&r.collection)?;
        self.ingestor.validate(&r.documents, &info)?;
        let grow = crate::schema::growth(&r.documents, &info)?;
        if !grow.is_empty() {
            let add = AddFieldsRequest {
                collection: info.name.clone(),
                fields: grow,
            };
            self.add_fields_as(add, &caller, forwarded).await?;
        }
        Ok(Response::new(self.ingestor.upsert(r, client).await?))
    }

    async fn delete_documents(
        &self,
        req: Request<DeleteDocumentsRequest>,
    ) -> Result<Response<DeleteDocumentsResponse>, Status> {
        let coll = req.get_ref().collection.clone();
        let _g = gate(
            &self.handles,
            &req,
            "DeleteDocuments",
            Role::Writer,
            Some(&coll),
        )?;
        let client = ragcluster_common::server::grpc_timeout(req.metadata());
        Ok(Response::new(
            self.ingestor.delete(req.into_inner(), client).await?,
        ))
    }

    async fn update_documents(
        &self,
        req: Request<UpdateDocumentsRequest>,
    ) -> Result<Response<UpdateDocumentsResponse>, Status> {
        let coll = req.get_ref().collection.clone();
        let (caller, _p) = gate(
            &self.handles,
            &req,
            "UpdateDocuments",
            Role::Writer,
            Some(&coll),
        )?;
        let client = ragcluster_common::server::grpc_timeout(req.metadata());
        let forwarded = is_forwarded(req.metadata());
        let r = req.into_inner();
        // As for upserts: fields the patch sets for the first time join the schema first.
        check_collection("collection", &r.collection)?;
        let (info, _) = self.handles.catalog.write_route(&r.collection)?;
        let grow = crate::ingest::check_patch(r.patch.as_ref(), &info)?;
        if !grow.is_empty() {
            let add = AddFieldsRequest {
                collection: info.name.clone(),
                fields: grow,
            };
            self.add_fields_as(add, &caller, forwarded).await?;
        }
        Ok(Response::new(self.ingestor.update(r, client).await?))
    }

    async fn search(
        &self,
        req: Request<SearchRequest>,
    ) -> Result<Response<SearchResponse>, Status> {
        let coll = req.get_ref().collection.clone();
        let _g = gate(&self.handles, &req, "Search", Role::Reader, Some(&coll))?;
        let md = req.metadata().clone();
        let mut r = req.into_inner();
        check_collection("collection", &r.collection)?;
        // The request's own value is checked before a client deadline can lower it.
        convert::check_timeout(r.timeout_ms, MAX_SEARCH_TIMEOUT_MS)?;
        r.timeout_ms = tighter_timeout(r.timeout_ms, &md, MAX_SEARCH_TIMEOUT_MS);
        let info = self.handles.catalog.get(&r.collection)?;
        let q = convert::search_query(&r, &info, self.search_timeout, self.max_top_k)?;
        let results = self.searcher.search(q).await?;
        Ok(Response::new(convert::search_response(results)))
    }

    type AskStream = Admitted<tokio_stream::wrappers::ReceiverStream<Result<AskResponse, Status>>>;

    async fn ask(&self, req: Request<AskRequest>) -> Result<Response<Self::AskStream>, Status> {
        let coll = req.get_ref().collection.clone();
        let (_caller, permit) = gate(&self.handles, &req, "Ask", Role::Reader, Some(&coll))?;
        let md = req.metadata().clone();
        let mut r = req.into_inner();
        check_collection("collection", &r.collection)?;
        convert::check_timeout(r.timeout_ms, MAX_ASK_TIMEOUT_MS)?;
        r.timeout_ms = tighter_timeout(r.timeout_ms, &md, MAX_ASK_TIMEOUT_MS);
        let rx = self.engine.ask(r).await?;
        Ok(Response::new(Admitted {
            inner: tokio_stream::wrappers::ReceiverStream::new(rx),
            _permit: permit,
        }))
    }

    async fn get_documents(
        &self,
        req: Request<GetDocumentsRequest>,
    ) -> Result<Response<GetDocumentsResponse>, Status> {
        let md = req.metadata().clone();
        let coll = req.get_ref().collection.clone();
        let _g = gate(
            &self.handles,
            &req,
            "GetDocuments",
            Role::Reader,
            Some(&coll),
        )?;
        let mut r = req.into_inner();
        convert::check_timeout(r.timeout_ms, MAX_SEARCH_TIMEOUT_MS)?;
        r.timeout_ms = tighter_timeout(r.timeout_ms, &md, MAX_SEARCH_TIMEOUT_MS);
        Ok(Response::new(self.documents.get(r).await?))
    }

    async fn scroll(
        &self,
        req: Request<ScrollRequest>,
    ) -> Result<Response<ScrollResponse>, Status> {
        let md = req.metadata().clone();
        let coll = req.get_ref().collection.clone();
        let _g = gate(&self.handles, &req, "Scroll", Role::Reader, Some(&coll))?;
        let mut r = req.into_inner();
        convert::check_timeout(r.timeout_ms, MAX_SEARCH_TIMEOUT_MS)?;
        r.timeout_ms = tighter_timeout(r.timeout_ms, &md, MAX_SEARCH_TIMEOUT_MS);
        Ok(Response::new(self.documents.scroll(r).await?))
    }

    async fn count(&self, req: Request<CountRequest>) -> Result<Response<CountResponse>, Status> {
        let md = req.metadata().clone();
        let coll = req.get_ref().collection.clone();
        let _g = gate(&self.handles, &req, "Count", Role::Reader, Some(&coll))?;
        let mut r = req.into_inner();
        convert::check_timeout(r.timeout_ms, MAX_SEARCH_TIMEOUT_MS)?;
        r.timeout_ms = tighter_timeout(r.timeout_ms, &md, MAX_SEARCH_TIMEOUT_MS);
        Ok(Response::new(self.documents.count(r).await?))
    }

    async fn add_fields(
        &self,
        req: Request<AddFieldsRequest>,
    ) -> Result<Response<AddFieldsResponse>, Status> {
        let coll = req.get_ref().collection.clone();
        let (caller, _p) = gate(&self.handles, &req, "AddFields", Role::Writer, Some(&coll))?;
        let forwarded = is_forwarded(req.metadata());
        let mut r = req.into_inner();
        check_collection("collection", &r.collection)?;
        if r.fields.is_empty() {
            return Err(crate::error::CoordError::invalid("fields", "is empty").into());
        }
        crate::schema::check_fields("fields", &r.fields)?;
        // An alias stands for its collection here too; the catalog entry names the collection.
        r.collection = self.handles.catalog.get(&r.collection)?.name;
        let fields = self.add_fields_as(r, &caller, forwarded).await?;
        Ok(Response::new(AddFieldsResponse { fields }))
    }

    async fn update_aliases(
        &self,
        req: Request<UpdateAliasesRequest>,
    ) -> Result<Response<UpdateAliasesResponse>, Status> {
        let h = &self.handles;
        // Aliases are one namespace over every collection: a cluster operation.
        let (caller, _p) = gate(h, &req, "UpdateAliases", Role::Admin, None)?;
        check_alias_actions(req.get_ref())?;
        let target = h
            .catalog
            .change_target(is_forwarded(req.metadata()))
            .await?;
        let r = req.into_inner();
        match target {
            None => self.collections.update_aliases(r).await?,
            Some(leader) => {
                let want = r.clone();
                self.forward.update_aliases(&leader, r, &caller).await?;
                h.catalog
                    .wait_for(|v| aliases_applied(v, &want), CATCH_UP)
                    .await;
            }
        }
        Ok(Response::new(UpdateAliasesResponse {
            aliases: h.catalog.aliases(None),
        }))
    }

    async fn list_aliases(
        &self,
        req: Request<ListAliasesRequest>,
    ) -> Result<Response<ListAliasesResponse>, Status> {
        let h = &self.handles;
        let (caller, _p) = list_gate(h, &req, "ListAliases")?;
        let r = req.into_inner();
        if !r.collection.is_empty() {
            check_collection("collection", &r.collection)?;
        }
        let mut aliases = h
            .catalog
            .aliases((!r.collection.is_empty()).then_some(r.collection.as_str()));
        aliases.retain(|a| caller.may_see(&a.collection));
        Ok(Response::new(ListAliasesResponse { aliases }))
    }
}

impl CoordinatorService {
    /// Adds fields to a collection's schema on the catalog leader (forwarded there with the
    /// caller's key when this coordinator does not lead), and waits until this coordinator's
    /// catalog shows them. Returns the schema after.
    async fn add_fields_as(
        &self,
        r: AddFieldsRequest,
        caller: &Caller,
        forwarded: bool,
    ) -> Result<Vec<FieldSchema>, Status> {
        let h = &self.handles;
        match h.catalog.change_target(forwarded).await? {
            None => Ok(self.collections.add_fields(r).await?),
            Some(leader) => {
                let fields = self.forward.add_fields(&leader, r.clone(), caller).await?;
                h.catalog
                    .wait_for(
                        |v| {
                            v.collections
                                .get(&r.collection)
                                .is_some_and(|c| crate::schema::holds(c, &r.fields))
                        },
                        CATCH_UP,
                    )
                    .await;
                Ok(fields)
            }
        }
    }
}

/// Whether this coordinator's catalog shows `r`'s outcome (a forwarded change).
fn aliases_applied(v: &crate::catalog::View, r: &UpdateAliasesRequest) -> bool {
    let mut want = std::collections::BTreeMap::new();
    for a in &r.actions {
        match &a.action {
            Some(alias_action::Action::Put(p)) => want.insert(&p.alias, Some(&p.collection)),
            Some(alias_action::Action::Delete(d)) => want.insert(d, None),
            None => None,
        };
    }
    want.into_iter()
        .all(|(alias, to)| v.aliases.get(alias) == to)
}

/// The gate of a listing: any reader may list, and sees only what its key may touch (the
/// caller filters by `Caller::may_see`).
fn list_gate<T>(
    h: &Handles,
    req: &Request<T>,
    what: &str,
) -> Result<(Caller, crate::auth::Permit), Status> {
    let caller = h.auth.authenticate(req.metadata(), &h.catalog)?;
    let unscoped = Caller {
        collections: Vec::new(),
        ..caller.clone()
    };
    check(&unscoped, what, Role::Reader, None)?;
    let permit = h.auth.admit(&caller)?;
    Ok((caller, permit))
}
