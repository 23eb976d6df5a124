//! Pre-retrieval operators: LLM query transforms (rewrite, HyDE, multi-query, decomposition,
//! step-back).

use super::llm_prompt;
use super::{At, Operator};
use crate::error::Result;
use crate::flow::llm;
use crate::flow::run::{Ctx, Note, Run};
use crate::flow::spec::Op;

pub struct QueryTransforms;

#[tonic::async_trait]
impl Operator for QueryTransforms {
    async fn run(&self, rt: &Run, op: &Op, _at: At<'_>, ctx: &mut Ctx) -> Result<Note> {
        match op {
            Op::Rewrite(l) => {
                let g = llm_prompt(rt, l, ctx, &[]).await?;
                if let Some(q) = llm::one_line(&g.text) {
                    ctx.query = q;
                }
            }
            Op::Hyde(l) => {
                let g = llm_prompt(rt, l, ctx, &[]).await?;
                ctx.hyde = Some(g.text.trim().to_owned()).filter(|t| !t.is_empty());
            }
            Op::MultiQuery { llm: l, n } => {
                let g = llm_prompt(rt, l, ctx, &[("n", &n.to_string())]).await?;
                let mut qs = vec![ctx.query.clone()];
                qs.extend(llm::lines(&g.text, *n, &qs.clone()));
                ctx.queries = qs;
            }
            Op::Decompose { llm: l, n } => {
                let g = llm_prompt(rt, l, ctx, &[("n", &n.to_string())]).await?;
                let subs = llm::lines(&g.text, *n, std::slice::from_ref(&ctx.query));
                ctx.queries = if subs.is_empty() {
                    vec![ctx.query.clone()]
                } else {
                    subs
                };
            }
            Op::StepBack(l) => {
                let g = llm_prompt(rt, l, ctx, &[]).await?;
                ctx.queries = vec![ctx.query.clone()];
                if let Some(q) = llm::one_line(&g.text) {
                    ctx.queries.push(q);
                }
            }
            _ => {}
        }
        Ok(Note::default())
    }
}
