//! Evaluation on BEIR-format data (`ragctl eval`): dataset loading (`beir`) and retrieval
//! metrics computed as trec_eval does, plus the AutoRAG seed's context precision (`metrics`).

pub mod beir;
pub mod metrics;
