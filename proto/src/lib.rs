//! The ragcluster gRPC contract (package `ragcluster.v1`), generated from `ragcluster/v1/*.proto`
//! at build time. Nothing else lives here: domain types belong to the process crates.

pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("ragcluster.v1");

    /// Encoded descriptors of every service, for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("ragcluster_descriptor");
}
