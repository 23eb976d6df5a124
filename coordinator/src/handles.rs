//! What every component and RPC handler may reach: the replicated catalog, the shard client,
//! the model worker client and API keys. Handles only: the work lives in the components
//! (`collections`, `ingest`, `search`, `flow`, `rebalance`), each in its own file.

use std::sync::Arc;

use crate::auth::Auth;
use crate::catalog::Catalog;
use crate::models::Models;
use crate::shards::Shards;

pub struct Handles {
    pub catalog: Arc<Catalog>,
    pub shards: Arc<Shards>,
    pub models: Arc<Models>,
    pub auth: Arc<Auth>,
}
