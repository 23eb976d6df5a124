//! Replication: every shard replica is a member of one Raft group, run by the shared core
//! (`ragcluster_raft`). What is the shard's own lives here:
//!
//! - `machine`: the shard as the group's state machine (apply to RocksDB, hand the indexes to
//!   the index worker, snapshots as files).
//! - `replica`: the handle RPCs use: writes that answer once visible, read index, membership.
//! - `transport`: how shard nodes reach each other: one gRPC stream per peer node carrying the
//!   messages of every group, snapshots streamed on their own call.
//! - `snapshot`: snapshot files (the shard's RocksDB records), checked by size and CRC32.
//! - `graph_follow`: followers load their leader's HNSW dumps instead of building a graph.

pub mod graph_follow;
pub mod machine;
pub mod replica;
pub mod snapshot;
pub mod transport;

pub use replica::Replica;
pub use transport::GrpcDialer;

pub use crate::error::LeaderHint;
