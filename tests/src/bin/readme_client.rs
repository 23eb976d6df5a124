//! The README's Rust client, verbatim below this comment: built with the workspace and run
//! against a demo cluster by tests/tests/readme.rs, which also checks that the README still
//! shows exactly this code.

use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::{SearchMode, SearchRequest};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::var("RAGCLUSTER")?;
    let mut client = CoordinatorClient::connect(format!("http://{addr}")).await?;
    let res = client
        .search(SearchRequest {
            collection: "docs".into(),
            query: "how does raft elect a leader?".into(),
            top_k: 3,
            mode: SearchMode::Dense as i32,
            ..Default::default()
        })
        .await?
        .into_inner();
    for hit in res.hits {
        println!("{:.3} {} ({})", hit.score, hit.doc_id, hit.section);
    }
    Ok(())
}
