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
/// Bytes of a read token (the largest, for `MAX_SHARDS` shards, is about 3.5 KiB).
pub const MAX_READ_TOKEN_BYTES: usize = 8 * 1024;

/// Chunks per Scroll page (and its default).
pub const MAX_SCROLL_LIMIT: u32 = 1000;
pub const DEFAULT_SCROLL_LIMIT: u32 = 100;
/// Encoded chunk bytes of one Scroll page: under the 4 MiB a gRPC client takes by default.
pub const MAX_SCROLL_PAGE_BYTES: usize = 2 << 20;
/// Bytes of a Scroll cursor (a read token and a document id inside).
pub const MAX_CURSOR_BYTES: usize = 16 * 1024;

/// Actions per UpdateAliases call (each one catalog entry holds them all).
pub const MAX_ALIAS_ACTIONS: usize = 64;
/// Aliases in the whole catalog (it travels whole in catalog snapshots).
pub const MAX_ALIASES: usize = 10_000;

/// Typed fields: in a collection's schema, per document, bytes of a name, elements of a
/// keyword list, and the largest integer or datetime (ranges compare doubles, exact up to it).
pub const MAX_SCHEMA_FIELDS: usize = 256;
pub const MAX_DOC_FIELDS: usize = 64;
pub const MAX_FIELD_NAME_BYTES: usize = MAX_METADATA_KEY_BYTES;
pub const MAX_KEYWORD_LIST: usize = 64;
pub const MAX_KEYWORD_BYTES: usize = 1024;
pub const MAX_SAFE_INTEGER: i64 = 1 << 53;
/// A filter: conditions in all, levels of nesting, values of one AnyOf.
pub const MAX_FILTER_CONDITIONS: usize = 64;
pub const MAX_FILTER_DEPTH: usize = 8;
pub const MAX_ANY_OF: usize = 1024;
/// Keys set and deleted by one UpdateDocuments patch, all four lists together.
pub const MAX_PATCH_ENTRIES: usize = 64;

/// Bytes of one RestoreDocuments call (documents per call: `MAX_DOCS_PER_BATCH`).
pub const MAX_RESTORE_BYTES: usize = 64 << 20;

/// Copy batches a re-embedding keeps in flight per shard (`ReembedRequest.parallel`), and
/// the documents of one such batch.
pub const MAX_REEMBED_PARALLEL: u32 = 16;
pub const DEFAULT_REEMBED_PARALLEL: u32 = 2;
pub const REEMBED_BATCH_DOCUMENTS: usize = 64;

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
/// Worked examples of one prompt step, and the bytes of each of their fields. Each example is
/// two chat turns: 2 x 8 + MAX_HISTORY stays within the model worker's 64 turns.
pub const MAX_PROMPT_EXAMPLES: usize = 8;
pub const MAX_EXAMPLE_FIELD_BYTES: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    /// Comment text of a proto file (or any text) with runs of whitespace made one space.
    fn flat(text: &str) -> String {
        text.lines()
            .map(|l| l.trim().trim_start_matches("//").trim())
            .collect::<Vec<_>>()
            .join(" ")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn read(path: &str) -> String {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        flat(&std::fs::read_to_string(root.join(path)).unwrap())
    }

    fn assert_states(name: &str, text: &str, stated: &str) {
        assert!(text.contains(stated), "{name} does not state {stated:?}");
    }

    fn fmt_thousands(n: usize) -> String {
        match n {
            n if n >= 1000 => format!("{},{:03}", n / 1000, n % 1000),
            n => n.to_string(),
        }
    }

    fn size(bytes: usize) -> String {
        match bytes {
            b if b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
            b if b % 1024 == 0 => format!("{} KiB", b >> 10),
            b => format!("{b} bytes"),
        }
    }

    /// Every limit the proto comments and the README state is this table's value: a cap
    /// changed here without its documentation (or the reverse) fails.
    #[test]
    fn documented_limits_are_the_enforced_ones() {
        let proto = read("proto/ragcluster/v1/coordinator.proto");
        let stated = [
            format!("at most {MAX_DOCS_PER_BATCH} documents per call"),
            format!("{} of text per document", size(MAX_DOC_BYTES)),
            format!("Non-empty, at most {MAX_ID_BYTES} bytes, unique within the batch"),
            format!("Non-empty, at most {} (UTF-8 bytes)", size(MAX_DOC_BYTES)),
            format!("Number of shards, default 3, range [1, {MAX_SHARDS}]"),
            format!("at most {}. string query = 2;", size(MAX_QUERY_BYTES)),
            format!("at most {}. string question = 2;", size(MAX_QUESTION_BYTES)),
            format!("Hits to return, required, range [1, {MAX_SEARCH_TOP_K}]"),
            format!("max(top_k, 50) for hybrid, at most {MAX_SEARCH_TOP_K}"),
            format!("coordinator.search_timeout (5 s), at most {MAX_SEARCH_TIMEOUT_MS}"),
            format!("coordinator.ask_timeout (120 s), at most {MAX_ASK_TIMEOUT_MS}"),
            format!("(at most {MAX_HISTORY})"),
            format!("At most {}; a token", size(MAX_READ_TOKEN_BYTES)),
            format!(
                "Non-empty, at most {MAX_DOCS_PER_BATCH} ids, each non-empty and at most {MAX_ID_BYTES} bytes"
            ),
            format!(
                "Chunks per page, default {DEFAULT_SCROLL_LIMIT}, range [1, {MAX_SCROLL_LIMIT}]; a page also ends before it passes {}",
                size(MAX_SCROLL_PAGE_BYTES)
            ),
            format!(
                "(another is INVALID_ARGUMENT). At most {}.",
                size(MAX_CURSOR_BYTES)
            ),
            format!("At most {MAX_ALIAS_ACTIONS} actions per call."),
            format!("at most {} aliases in all", fmt_thousands(MAX_ALIASES)),
            format!("Passages each retrieval step returns, [1, {MAX_FLOW_TOP_K}]"),
            format!("[1, min({MAX_STEP_TOKENS}, coordinator.ask_max_generated_tokens)]"),
            format!("default 8, at most {MAX_FLOW_BRANCHES})"),
            format!("default 4, at most {MAX_FLOW_ITERATIONS})"),
            format!("Typed fields declared up front (at most {MAX_SCHEMA_FIELDS})"),
            format!("more than {MAX_SCHEMA_FIELDS} fields in the schema is RESOURCE_EXHAUSTED"),
            format!("Typed fields (at most {MAX_DOC_FIELDS}, names as FieldSchema's"),
            format!(
                "At most {MAX_DOCS_PER_BATCH} ids and {MAX_PATCH_ENTRIES} patch entries per call"
            ),
        ];
        for s in &stated {
            assert!(
                proto.contains(s.as_str()),
                "coordinator.proto does not state {s:?}"
            );
        }
        let common = read("proto/ragcluster/v1/common.proto");
        let stated = [
            format!("Names are 1 to {MAX_FIELD_NAME_BYTES} bytes"),
            format!("Up to {MAX_KEYWORD_LIST} keywords"),
            format!("At most {} (as a metadata value)", size(MAX_KEYWORD_BYTES)),
            format!(
                "At most {MAX_FILTER_CONDITIONS} conditions in all and {MAX_FILTER_DEPTH} levels of nesting"
            ),
            format!("at most {} values", fmt_thousands(MAX_ANY_OF)),
            format!("Within +-2^{}", MAX_SAFE_INTEGER.trailing_zeros()),
            format!("at most {MAX_PATCH_ENTRIES} entries in all"),
        ];
        for s in &stated {
            assert!(
                common.contains(s.as_str()),
                "common.proto does not state {s:?}"
            );
        }
        let flows = read("coordinator/flows/examples.toml").replace(" # ", " ");
        let stated = format!(
            "(at most {MAX_PROMPT_EXAMPLES}, each field at most {})",
            size(MAX_EXAMPLE_FIELD_BYTES)
        );
        assert_states("flows/examples.toml", &flows, &stated);
        let admin = read("proto/ragcluster/v1/admin.proto");
        let stated = format!(
            "At most {MAX_DOCS_PER_BATCH} documents and {} per call",
            size(MAX_RESTORE_BYTES)
        );
        assert_states("admin.proto", &admin, &stated);
        let stated = format!(
            "Copy batches in flight per shard, at most {MAX_REEMBED_PARALLEL} (0: {DEFAULT_REEMBED_PARALLEL})"
        );
        assert_states("admin.proto", &admin, &stated);
        let readme = read("README.md");
        let stated = [
            format!(
                "Limits: {MAX_DOCS_PER_BATCH} documents per upsert, {} per document",
                size(MAX_DOC_BYTES)
            ),
            format!("document ids ≤ {MAX_ID_BYTES} bytes"),
            format!("{MAX_ALIAS_ACTIONS} actions per `UpdateAliases`"),
            format!("filters of at most {MAX_FILTER_CONDITIONS} conditions"),
            format!(
                "{MAX_DOCS_PER_BATCH} documents and {} per `RestoreDocuments`",
                size(MAX_RESTORE_BYTES)
            ),
            format!("{MAX_DOCS_PER_BATCH} ids per `GetDocuments`"),
            format!(
                "{},{:03} chunks (and {}) per `Scroll` page",
                MAX_SCROLL_LIMIT / 1000,
                MAX_SCROLL_LIMIT % 1000,
                size(MAX_SCROLL_PAGE_BYTES)
            ),
            format!(
                "`top_k` in [1, {MAX_SEARCH_TOP_K}], query ≤ {}",
                size(MAX_QUERY_BYTES)
            ),
        ];
        for s in &stated {
            assert!(readme.contains(s.as_str()), "README does not state {s:?}");
        }
    }
}
