//! Client helpers shared by the CLI, the benchmarks and the tests.

use ragcluster_proto::v1::{AskRequest, AskResult, ask_response};

/// A client of `Ask` that needs only the outcome: drains the stream (tokens ignored) to its
/// `AskResult`. A flow that fails after it started returns its error status.
pub async fn ask_result<T>(
    c: &mut ragcluster_proto::v1::coordinator_client::CoordinatorClient<T>,
    r: AskRequest,
) -> std::result::Result<AskResult, tonic::Status>
where
    T: tonic::client::GrpcService<tonic::body::Body, ResponseBody = tonic::body::Body>,
    T::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    use futures::StreamExt;
    let mut s = c.ask(r).await?.into_inner();
    let mut result = None;
    while let Some(m) = s.next().await {
        if let Some(ask_response::Event::Result(r)) = m?.event {
            result = Some(r);
        }
    }
    result.ok_or_else(|| tonic::Status::internal("the Ask stream ended without a result"))
}
