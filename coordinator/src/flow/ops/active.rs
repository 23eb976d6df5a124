//! Active retrieval (FLARE, Algorithm 7).

use ragcluster_proto::v1::*;

use super::make_prompt;
use super::retrieval::retrieve;
use super::{At, Operator};
use crate::error::Result;
use crate::flow::citations::render;
use crate::flow::llm;
use crate::flow::run::{Ctx, Note, Run};
use crate::flow::run::{Generated, Prompt};
use crate::flow::spec::Op;
use crate::flow::spec::{GenerateParams, Retrieve};

pub struct Active;

#[tonic::async_trait]
impl Operator for Active {
    async fn run(&self, rt: &Run, op: &Op, at: At<'_>, ctx: &mut Ctx) -> Result<Note> {
        let mut note = Note::default();
        let path = at.path;
        let stream = at.stream;
        if let Op::Active {
            threshold,
            max_sentences,
            max_retrievals,
            sentence_tokens,
            retrieve: r,
            template,
            system,
            generation,
        } = op
        {
            let (n, why) = active(
                rt,
                ctx,
                ActiveParams {
                    threshold: *threshold,
                    max_sentences: *max_sentences,
                    max_retrievals: *max_retrievals,
                    sentence_tokens: *sentence_tokens,
                    retrieve: r,
                    template,
                    system,
                    generation,
                },
                stream.then_some(path),
            )
            .await?;
            note.iteration = n as u32;
            note.decision = why;
        }
        Ok(note)
    }
}

struct ActiveParams<'a> {
    threshold: f32,
    max_sentences: usize,
    max_retrievals: usize,
    sentence_tokens: usize,
    retrieve: &'a Retrieve,
    template: &'a str,
    system: &'a str,
    generation: &'a GenerateParams,
}

/// The first sentence of a generation: tokens up to and including the one that ends it.
fn first_sentence(g: &Generated) -> (usize, bool) {
    let mut text = String::new();
    for (i, t) in g.tokens.iter().enumerate() {
        text.push_str(t);
        let trimmed = text.trim_end();
        let ends = trimmed.ends_with(['.', '!', '?']) || (t.contains('\n') && !trimmed.is_empty());
        if ends && trimmed.len() > 1 {
            return (i + 1, false);
        }
    }
    (g.tokens.len(), true)
}

/// FLARE (active retrieval, Algorithm 7): generate the answer a sentence at a time, continuing
/// the accepted prefix; when a sentence has a token below `threshold`, retrieve with the
/// sentence's confident tokens (FLARE's masked query) and regenerate it with the new contexts.
async fn active(
    rt: &Run,
    ctx: &mut Ctx,
    p: ActiveParams<'_>,
    stream: Option<&str>,
) -> Result<(usize, String)> {
    let mut contexts = ctx.chunks.clone();
    let mut answer = Generated::default();
    let mut retrievals = 0;
    let mut sentences = 0;
    let mut log = Vec::new();
    let budget = rt.overrides.max_tokens.unwrap_or(p.generation.max_tokens);
    let model = rt
        .overrides
        .generate_model
        .clone()
        .unwrap_or_else(|| p.generation.model.clone());
    while sentences < p.max_sentences && answer.tokens.len() < budget {
        let prompt = make_prompt(rt, p.template, p.system, &[], &ctx.query, &contexts);
        let ask = |prefix: String, prompt: &Prompt| GenerateRequest {
            model: model.clone(),
            prompt: prompt.user.clone(),
            system: prompt.system.clone(),
            max_tokens: p.sentence_tokens.min(budget - answer.tokens.len()).max(1) as u32,
            temperature: rt.overrides.temperature.unwrap_or(p.generation.temperature),
            history: rt.history.clone(),
            stop: p.generation.stop.clone(),
            assistant_prefix: prefix,
            ..Default::default()
        };
        let mut g = llm::generate(rt, ask(answer.text.clone(), &prompt), None).await?;
        let (mut n, mut done) = first_sentence(&g);
        if n == 0 {
            break;
        }
        let min = g.logprobs[..n]
            .iter()
            .map(|l| l.exp())
            .fold(1.0f32, f32::min);
        if min < p.threshold && retrievals < p.max_retrievals {
            // Masked query: the question plus the sentence's confident tokens.
            let confident: String = g.tokens[..n]
                .iter()
                .zip(&g.logprobs[..n])
                .filter(|(_, l)| l.exp() >= p.threshold)
                .map(|(t, _)| t.as_str())
                .collect();
            let q = format!("{} {}", rt.question, confident.trim());
            let found = retrieve(rt, p.retrieve, &q, None, 1).await?;
            retrievals += 1;
            for f in found {
                if !contexts.iter().any(|c| c.chunk_id == f.chunk_id) {
                    contexts.push(f);
                }
            }
            let prompt = make_prompt(rt, p.template, p.system, &[], &ctx.query, &contexts);
            g = llm::generate(rt, ask(answer.text.clone(), &prompt), None).await?;
            (n, done) = first_sentence(&g);
            log.push(format!(
                "sentence {} below {} ({min:.3}): retrieved, regenerated",
                sentences + 1,
                p.threshold
            ));
            if n == 0 {
                break;
            }
        }
        let finished = g.finish == "stop" && n == g.tokens.len();
        for (t, l) in g.tokens[..n].iter().zip(&g.logprobs[..n]) {
            answer.text.push_str(t);
            answer.tokens.push(t.clone());
            answer.logprobs.push(*l);
            if let Some(step) = stream
                && !t.is_empty()
            {
                if sentences == 0 && answer.tokens.len() == 1 {
                    rt.begin_answer(step).await;
                }
                rt.emit_token(AskToken {
                    text: t.clone(),
                    logprob: *l,
                    step: step.to_owned(),
                    restart: false,
                })
                .await;
            }
        }
        sentences += 1;
        if done || finished {
            break;
        }
    }
    let (_, used) = render(&contexts);
    contexts.truncate(used);
    ctx.prompt = Some(make_prompt(
        rt,
        p.template,
        p.system,
        &[],
        &ctx.query,
        &contexts,
    ));
    ctx.contexts = contexts;
    ctx.answer = Some(answer);
    let why = if log.is_empty() {
        format!("{sentences} sentences, all confident")
    } else {
        format!(
            "{sentences} sentences, {retrievals} retrievals: {}",
            log.join("; ")
        )
    };
    Ok((sentences, why))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentences_of_a_generation() {
        let g = Generated {
            tokens: vec![
                "Paris".into(),
                " is".into(),
                " big".into(),
                ".".into(),
                " It".into(),
            ],
            logprobs: vec![0.0; 5],
            ..Default::default()
        };
        assert_eq!(first_sentence(&g), (4, false));
        let g = Generated {
            tokens: vec!["no".into(), " end".into()],
            logprobs: vec![0.0; 2],
            ..Default::default()
        };
        assert_eq!(first_sentence(&g), (2, true));
    }
}
