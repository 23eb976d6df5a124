//! The subcommands that have their own files.

pub mod aliases;
pub mod ask;
pub mod backup;
pub mod browse;
pub mod docs;
pub mod edit;
pub mod eval;
pub mod ingest;
pub mod keys;
pub mod local;
pub mod ops;
pub mod optimize;
pub mod reembed;
pub mod report;
pub mod status;
