//! The subcommands that have their own files.

pub mod eval;
pub mod keys;
pub mod ops;
pub mod optimize;
pub mod report;
