//! Generates the tonic/prost code for every service at build time (never committed) and a
//! file descriptor set for gRPC server reflection.
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let protos = [
        "ragcluster/v1/common.proto",
        "ragcluster/v1/coordinator.proto",
        "ragcluster/v1/shard.proto",
        "ragcluster/v1/model_worker.proto",
        "ragcluster/v1/admin.proto",
        "ragcluster/v1/catalog.proto",
        "ragcluster/v1/failpoints.proto",
        "ragcluster/v1/membership.proto",
    ];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("ragcluster_descriptor.bin"))
        // Decoded as a slice of the received buffer, not copied (coordinator search merge).
        .bytes(".ragcluster.v1.ShardHit.chunk_encoded")
        .compile_protos(&protos, &["."])?;
    Ok(())
}
