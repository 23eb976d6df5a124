//! Control operators that steer the flow: route into another flow (keyword, semantic or
//! hybrid routing, eq. 19-22), loop until a judge accepts, or do nothing (noop).

use super::run_steps;
use super::{At, Operator};
use crate::error::CoordError;
use crate::error::Result;
use crate::flow::llm;
use crate::flow::route;
use crate::flow::run::{Ctx, Note, Run};
use crate::flow::spec::Op;
use crate::flow::spec::{RouteMethod, RouteTarget};
use ragcluster_proto::v1::EmbedInput;

pub struct Control;

#[tonic::async_trait]
impl Operator for Control {
    async fn run(&self, rt: &Run, op: &Op, at: At<'_>, ctx: &mut Ctx) -> Result<Note> {
        let mut note = Note::default();
        let (path, stream) = (at.path, at.stream);
        match op {
            Op::Route {
                method,
                alpha,
                temperature,
                routes,
                default,
            } => {
                let (flow, why) = choose(
                    rt,
                    (&rt.question, &ctx.query),
                    *method,
                    *alpha,
                    *temperature,
                    routes,
                    default,
                )
                .await?;
                note.decision = why;
                let f = rt.flows.flows.get(&flow).ok_or_else(|| {
                    CoordError::invalid("flow", format!("route target {flow:?} is gone"))
                })?;
                run_steps(rt, &f.steps, ctx, &format!("{path}/{flow}:"), stream).await?;
            }
            Op::Loop {
                max_iterations,
                augment_query,
                steps,
            } => {
                let bound = (*max_iterations).min(rt.limits.max_iterations).max(1);
                let mut it = 0;
                note.decision = format!("max_iterations {bound} reached");
                while it < bound {
                    it += 1;
                    if it > 1 && *augment_query {
                        // ITER-RETGEN: the next retrieval sees the question and the last answer.
                        if let Some(a) = &ctx.answer {
                            ctx.query = format!("{} {}", rt.question, a.text.trim());
                        }
                    }
                    ctx.verdict = None;
                    run_steps(rt, steps, ctx, &format!("{path}#{it}/"), stream).await?;
                    if ctx.verdict == Some(true) {
                        note.decision = format!("judge accepted at iteration {it}");
                        break;
                    }
                }
                note.iteration = it as u32;
            }
            _ => {}
        }
        Ok(note)
    }
}

async fn intent_vectors(rt: &Run, routes: &[RouteTarget]) -> Result<Vec<Vec<Vec<f32>>>> {
    let model = rt.info.embedding_model.clone();
    let missing: Vec<String> = {
        let c = rt.intents.0.lock();
        let mut m: Vec<String> = routes
            .iter()
            .flat_map(|r| r.intents.iter())
            .filter(|t| !c.contains_key(&(model.clone(), (*t).clone())))
            .cloned()
            .collect();
        m.dedup();
        m
    };
    if !missing.is_empty() {
        let vecs = llm::embed(rt, missing.clone(), EmbedInput::Query).await?;
        let mut c = rt.intents.0.lock();
        for (t, v) in missing.into_iter().zip(vecs) {
            c.insert((model.clone(), t), v);
        }
    }
    let c = rt.intents.0.lock();
    Ok(routes
        .iter()
        .map(|r| {
            r.intents
                .iter()
                .filter_map(|t| c.get(&(model.clone(), t.clone())).cloned())
                .collect()
        })
        .collect())
}

/// The chosen flow and a line saying why (every target's scores). The form is the user's
/// question's (a rewrite may drop its "Is ..."); the scores read the current query.
async fn choose(
    rt: &Run,
    (question, query): (&str, &str),
    method: RouteMethod,
    alpha: f32,
    temperature: f32,
    routes: &[RouteTarget],
    default: &str,
) -> Result<(String, String)> {
    if method == RouteMethod::Form {
        let form = route::form_of(question);
        let chosen = match route::form_target(form, routes) {
            Some(i) => routes[i].flow.clone(),
            None if !default.is_empty() => default.to_owned(),
            None => routes[0].flow.clone(),
        };
        return Ok((chosen.clone(), format!("-> {chosen} (form {form:?})")));
    }
    let key = route::keyword_scores(query, routes);
    let sem = if method == RouteMethod::Keyword || routes.iter().all(|r| r.intents.is_empty()) {
        vec![0.0; routes.len()]
    } else {
        let q = llm::embed(rt, vec![query.to_owned()], EmbedInput::Query)
            .await?
            .pop()
            .unwrap_or_default();
        route::semantic_scores(&q, &intent_vectors(rt, routes).await?, temperature)
    };
    let a = match method {
        RouteMethod::Keyword => 1.0,
        RouteMethod::Semantic => 0.0,
        RouteMethod::Hybrid | RouteMethod::Form => alpha,
    };
    let scores: Vec<f32> = key
        .iter()
        .zip(&sem)
        .map(|(k, s)| a * k + (1.0 - a) * s)
        .collect();
    let best = scores
        .iter()
        .enumerate()
        .max_by(|x, y| x.1.total_cmp(y.1))
        .filter(|(_, s)| **s > 0.0)
        .map(|(i, _)| i);
    let chosen = match best {
        Some(i) => routes[i].flow.clone(),
        None if !default.is_empty() => default.to_owned(),
        None => routes[0].flow.clone(),
    };
    let detail: Vec<String> = routes
        .iter()
        .enumerate()
        .map(|(i, r)| {
            format!(
                "{} key {:.2} sem {:.2} = {:.3}",
                r.flow, key[i], sem[i], scores[i]
            )
        })
        .collect();
    Ok((
        chosen.clone(),
        format!("-> {chosen} ({})", detail.join("; ")),
    ))
}
