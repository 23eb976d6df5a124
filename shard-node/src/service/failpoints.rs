//! The test-only `Failpoints` service (cargo feature `failpoints`): lets process-level fault
//! tests configure this node's failpoints at run time.

use ragcluster_proto::v1::failpoints_server::Failpoints;
use ragcluster_proto::v1::{SetFailpointRequest, SetFailpointResponse};
use tonic::{Request, Response, Status};

pub struct FailpointService;

#[tonic::async_trait]
impl Failpoints for FailpointService {
    async fn set(
        &self,
        req: Request<SetFailpointRequest>,
    ) -> Result<Response<SetFailpointResponse>, Status> {
        let r = req.into_inner();
        if r.actions.is_empty() || r.actions == "off" {
            fail::remove(&r.name);
        } else {
            fail::cfg(&r.name, &r.actions).map_err(Status::invalid_argument)?;
        }
        tracing::warn!(name = %r.name, actions = %r.actions, "failpoint set");
        Ok(Response::new(SetFailpointResponse {}))
    }
}
