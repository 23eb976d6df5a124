//! Hard limits on what one request may ask for: the one table the README, the proto comments
//! and every validator refer to. `[coordinator.limits]` can only lower the configurable ones.

/// Documents per UpsertDocuments, ids per DeleteDocuments.
pub const MAX_DOCS_PER_BATCH: usize = 256;
/// UTF-8 bytes of one document's text.
pub const MAX_DOC_BYTES: usize = 1 << 20;
/// Bytes of a document id.
pub const MAX_ID_BYTES: usize = 512;
pub const MAX_TITLE_BYTES: usize = 4096;
pub const MAX_METADATA_ENTRIES: usize = 64;
/// Bytes of a metadata key.
pub const MAX_METADATA_KEY_BYTES: usize = 256;

/// Shards of one collection.
pub const MAX_SHARDS: u32 = 256;
/// Replicas of one shard.
pub const MAX_REPLICATION_FACTOR: u32 = 7;

/// top_k and candidates of a Search.
pub const MAX_SEARCH_TOP_K: u32 = 1000;
/// Bytes of a search query.
pub const MAX_QUERY_BYTES: usize = 8 * 1024;
/// Search.timeout_ms.
pub const MAX_SEARCH_TIMEOUT_MS: u32 = 60_000;

/// Bytes of an Ask question.
pub const MAX_QUESTION_BYTES: usize = 8 * 1024;
/// Earlier turns of an Ask conversation.
pub const MAX_HISTORY: usize = 32;
/// Ask.timeout_ms.
pub const MAX_ASK_TIMEOUT_MS: u32 = 600_000;

/// Caps no flow or request can raise.
pub const MAX_FLOW_BRANCHES: usize = 16;
pub const MAX_FLOW_ITERATIONS: usize = 8;
pub const MAX_FLOW_DEPTH: usize = 4;
/// top_k of a flow's retrieval step (and of Ask overrides).
pub const MAX_FLOW_TOP_K: usize = 100;
/// Generated tokens of one flow step.
pub const MAX_STEP_TOKENS: usize = 2048;
