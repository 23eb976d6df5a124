//! Evaluation on BEIR-format data (`ragctl eval`): dataset loading (`beir`) and retrieval
//! metrics computed as trec_eval does, plus the AutoRAG seed's context precision (`metrics`);
//! answer metrics from the seeds (`answers`).

pub mod answers;
pub mod beir;
pub mod metrics;
