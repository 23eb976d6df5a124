//! Chunk-tagged prompts and the citations of an answer.
//!
//! Contexts go into the prompt as `<chunk id="n">title > section\ntext</chunk>` (the seeds'
//! chunk-tagged prompt); a flow's template may tell the generator to cite them as `[n]` (the
//! default one does not: small models then answer "[1]" and nothing else). Afterwards every
//! marker in the answer (`[2]`, `[1, 3]`, `[chunk 2]`) is checked against the contexts that
//! were actually given: a number outside them is dropped and counted. Each kept citation
//! carries the answer sentence it supports and the span of the cited chunk that overlaps it
//! most. When a (small) model cites nothing, sentences are attributed to the context
//! sentence with the largest word overlap and flagged `attributed`, never presented as the
//! model's own citation; a short answer ("Yes.") is read together with its question.

use std::collections::HashSet;

pub use ragcluster_common::prompt::fill;
use ragcluster_common::prompt::{chunk_tag, citation_markers as markers};
use ragcluster_proto::v1::Citation;
use unicode_segmentation::UnicodeSegmentation;

use super::run::Passage;

/// Characters of context text placed in one prompt; later contexts are left out.
pub const MAX_CONTEXT_CHARS: usize = 6000;
pub const MAX_CONTEXTS: usize = 8;

/// Renders the contexts as numbered chunk tags; returns the text and how many were used.
pub fn render(contexts: &[Passage]) -> (String, usize) {
    let mut out = String::new();
    let mut used = 0;
    for (i, p) in contexts.iter().take(MAX_CONTEXTS).enumerate() {
        let tag = chunk_tag(i + 1, &p.title, &p.section, &p.text);
        if used > 0 && out.len() + tag.len() > MAX_CONTEXT_CHARS {
            break;
        }
        out.push_str(&tag);
        used += 1;
    }
    (out.trim_end().to_owned(), used)
}

/// Renumbers `[n]` markers of an answer through `map` (old number -> new), dropping markers
/// whose number has no image. Used when branch answers with their own numbering are joined.
pub fn renumber(answer: &str, map: &dyn Fn(u32) -> Option<u32>) -> String {
    let mut out = String::new();
    let mut last = 0;
    for (nums, s, e) in markers(answer) {
        out.push_str(&answer[last..s]);
        let mapped: Vec<String> = nums
            .iter()
            .filter_map(|n| map(*n))
            .map(|n| n.to_string())
            .collect();
        if !mapped.is_empty() {
            out.push_str(&format!("[{}]", mapped.join(", ")));
        }
        last = e;
    }
    out.push_str(&answer[last..]);
    out
}

fn words(s: &str) -> HashSet<String> {
    const STOP: &[&str] = &[
        "the", "a", "an", "of", "and", "or", "to", "in", "is", "are", "was", "it", "on", "for",
        "as", "by", "with", "that", "this", "be", "at", "from", "its", "which", "their",
    ];
    s.unicode_words()
        .map(str::to_lowercase)
        .filter(|w| !STOP.contains(&w.as_str()))
        .map(|w| numeral(&w).map_or(w, str::to_owned))
        .collect()
}

/// A number word as digits, so that an answer "5" is matched to a passage's "five children"
/// (and "five" to "5"): small generators answer counts in digits whatever the text says.
/// "one" stays a word: mostly a pronoun ("one of the"), it would tie an answer "1" to any
/// passage (CMU QA: "What is the first number on the page?" -> "1" was attributed to an
/// article that does not hold it).
fn numeral(w: &str) -> Option<&'static str> {
    Some(match w {
        "zero" => "0",
        "two" => "2",
        "three" => "3",
        "four" => "4",
        "five" => "5",
        "six" => "6",
        "seven" => "7",
        "eight" => "8",
        "nine" => "9",
        "ten" => "10",
        "eleven" => "11",
        "twelve" => "12",
        "thirteen" => "13",
        "fourteen" => "14",
        "fifteen" => "15",
        "sixteen" => "16",
        "seventeen" => "17",
        "eighteen" => "18",
        "nineteen" => "19",
        "twenty" => "20",
        "thirty" => "30",
        "forty" => "40",
        "fifty" => "50",
        "sixty" => "60",
        "seventy" => "70",
        "eighty" => "80",
        "ninety" => "90",
        _ => return None,
    })
}

/// Byte ranges of the sentences of `text`.
fn sentences(text: &str) -> Vec<(usize, usize)> {
    text.split_sentence_bound_indices()
        .map(|(s, t)| (s, s + t.len()))
        .filter(|(s, e)| !text[*s..*e].trim().is_empty())
        .collect()
}

/// Share of `a`'s words that also occur in `b`.
fn overlap(a: &HashSet<String>, b: &HashSet<String>) -> f32 {
    if a.is_empty() {
        return 0.0;
    }
    a.intersection(b).count() as f32 / a.len() as f32
}

/// The words of a context's title and section: the subject its sentences often leave out
/// ("It has five children." in the article "Grover Cleveland").
fn heading(ctx: &Passage) -> HashSet<String> {
    words(&format!("{} {}", ctx.title, ctx.section))
}

/// The sentence of `ctx` that shares most words with `claim`, each sentence read with the
/// context's heading (the first one if none does; ties go to the earlier sentence).
fn best_span(claim: &HashSet<String>, ctx: &Passage) -> (usize, usize, f32) {
    let head = heading(ctx);
    let text = &ctx.text;
    let mut best = (0, text.len(), -1.0f32);
    for (s, e) in sentences(text) {
        let mut w = words(&text[s..e]);
        w.extend(head.iter().cloned());
        let o = overlap(claim, &w);
        if o > best.2 {
            best = (s, e, o);
        }
    }
    best
}

/// The index of the highest score, the earliest (best-ranked context) among equals.
fn first_max(scores: impl Iterator<Item = (usize, f32)>) -> Option<(usize, f32)> {
    scores.fold(None, |best, (i, o)| match best {
        Some((_, b)) if b >= o => best,
        _ => Some((i, o)),
    })
}

fn cite(
    n: u32,
    ans: (usize, usize),
    ctx: &Passage,
    claim: &HashSet<String>,
    attributed: bool,
) -> Citation {
    let (s, e, _) = best_span(claim, ctx);
    Citation {
        number: n,
        chunk_id: ctx.chunk_id.clone(),
        doc_id: ctx.doc_id.clone(),
        title: ctx.title.clone(),
        span: ctx.text[s..e].trim().to_owned(),
        span_start: s as u32,
        span_end: e as u32,
        answer_start: ans.0 as u32,
        answer_end: ans.1 as u32,
        attributed,
    }
}

/// Minimum share of an answer sentence's words found in a context sentence for attribution.
pub const ATTRIBUTION_OVERLAP: f32 = 0.5;

/// Answer sentences with fewer content words than this ("Yes.", "Helsinki.") are attributed
/// as an answer to the question: the question's words join the claim.
const SHORT_CLAIM: usize = 3;

/// The context an uncited answer sentence comes from, and the words it was matched on: the
/// context sentence sharing at least `ATTRIBUTION_OVERLAP` of the sentence's words; failing
/// that, the context holding every content word of the sentence (yes/no aside) whose whole
/// text shares that much of the sentence and its question together ("18 years" to "How long
/// was his legal career?" spans no single sentence's wording). Contexts are read with their
/// headings, and among equal matches the better-ranked context wins.
fn attribute(
    sentence: &str,
    question: &str,
    contexts: &[Passage],
) -> Option<(usize, HashSet<String>)> {
    let own = words(sentence);
    let mut claim = own.clone();
    if own.len() < SHORT_CLAIM {
        claim.extend(words(question));
    }
    if claim.len() < SHORT_CLAIM {
        return None;
    }
    let best = first_max(
        contexts
            .iter()
            .enumerate()
            .map(|(i, c)| (i, best_span(&claim, c).2)),
    );
    if let Some((i, o)) = best
        && o >= ATTRIBUTION_OVERLAP
    {
        return Some((i, claim));
    }
    let answer: HashSet<String> = own
        .into_iter()
        .filter(|w| w != "yes" && w != "no")
        .collect();
    claim.extend(words(question));
    let (i, o) = first_max(
        contexts
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut w = words(&c.text);
                w.extend(heading(c));
                (i, w)
            })
            .filter(|(_, w)| answer.is_subset(w))
            .map(|(i, w)| (i, overlap(&claim, &w))),
    )?;
    (o >= ATTRIBUTION_OVERLAP).then_some((i, claim))
}

/// The validated citations of `answer` to `question` and how many markers were dropped.
pub fn extract(answer: &str, question: &str, contexts: &[Passage]) -> (Vec<Citation>, u32) {
    let sents = sentences(answer);
    let sentence_of = |pos: usize| {
        sents
            .iter()
            .copied()
            .find(|(s, e)| (*s..*e).contains(&pos))
            .unwrap_or((0, answer.len()))
    };
    let mut out: Vec<Citation> = Vec::new();
    let mut seen = HashSet::new();
    let mut dropped = 0;
    for (nums, start, _) in markers(answer) {
        let sent = sentence_of(start);
        let claim = words(&answer[sent.0..start]);
        let claim = if claim.is_empty() {
            words(&answer[sent.0..sent.1])
        } else {
            claim
        };
        for n in nums {
            match contexts.get((n as usize).wrapping_sub(1)) {
                Some(ctx) if n >= 1 => {
                    if seen.insert((n, sent.0)) {
                        out.push(cite(n, sent, ctx, &claim, false));
                    }
                }
                _ => dropped += 1,
            }
        }
    }
    if out.is_empty() && !contexts.is_empty() {
        // No usable marker (small generators answer better when not asked to cite): attribute
        // each sentence to the best-overlapping context sentence.
        for sent in sents {
            if let Some((i, claim)) = attribute(&answer[sent.0..sent.1], question, contexts) {
                out.push(cite(i as u32 + 1, sent, &contexts[i], &claim, true));
            }
        }
    }
    (out, dropped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_in_digits_is_attributed_to_its_number_word() {
        let ctx = vec![
            p("a#0", "Frances Folsom married him in 1886."),
            p("b#0", "Grover Cleveland had five children with Frances."),
        ];
        let q = "How many children did Grover Cleveland have?";
        let (cites, _) = extract("5", q, &ctx);
        assert_eq!(cites.len(), 1);
        assert_eq!(cites[0].doc_id, "b");
        assert!(cites[0].attributed);
        // "one" is read as a pronoun, not as 1.
        let ctx = vec![p("c#0", "One of the first pages shows the river.")];
        let (cites, _) = extract("1", "What is the first number on the page?", &ctx);
        assert!(cites.is_empty());
    }

    fn p(id: &str, text: &str) -> Passage {
        Passage {
            chunk_id: id.into(),
            doc_id: id.split('#').next().unwrap_or(id).into(),
            text: text.into(),
            ..Default::default()
        }
    }

    #[test]
    fn markers_are_validated_against_the_contexts() {
        let ctx = vec![
            p(
                "a#0",
                "Raft elects a leader by majority vote. Terms number the elections.",
            ),
            p("b#0", "BM25 saturates term frequency with k1."),
        ];
        let ans = "A leader is elected by majority vote [1]. BM25 uses k1 [2, 3]. See [chunk 9].";
        let (c, dropped) = extract(ans, "", &ctx);
        assert_eq!(dropped, 2, "3 and 9 were never given");
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].number, 1);
        assert_eq!(c[0].chunk_id, "a#0");
        assert_eq!(c[0].span, "Raft elects a leader by majority vote.");
        assert_eq!(
            &ans[c[0].answer_start as usize..c[0].answer_end as usize],
            "A leader is elected by majority vote [1]. "
        );
        assert_eq!(c[1].span, "BM25 saturates term frequency with k1.");
        assert!(!c[0].attributed);
    }

    #[test]
    fn uncited_answers_are_attributed_by_overlap() {
        let ctx = vec![p(
            "a#0",
            "The sky is blue. Raft elects a leader by majority vote among servers.",
        )];
        let (c, dropped) = extract(
            "Raft elects its leader by a majority vote. Bananas are yellow fruit.",
            "",
            &ctx,
        );
        assert_eq!(dropped, 0);
        assert_eq!(c.len(), 1);
        assert!(c[0].attributed);
        assert_eq!(
            c[0].span,
            "Raft elects a leader by majority vote among servers."
        );
    }

    #[test]
    fn a_short_answer_is_attributed_with_its_question() {
        let ctx = vec![
            p("a#0", "Kangaroos eat grass."),
            p(
                "b#0",
                "Lincoln was born in Kentucky. Abraham Lincoln was the sixteenth President of \
                 the United States.",
            ),
        ];
        let q = "Was Abraham Lincoln the sixteenth President of the United States?";
        let (c, _) = extract("Yes.", q, &ctx);
        assert_eq!(c.len(), 1);
        assert!(c[0].attributed);
        assert_eq!(c[0].chunk_id, "b#0");
        assert_eq!(
            c[0].span,
            "Abraham Lincoln was the sixteenth President of the United States."
        );
        // Without a question a bare "Yes." says too little to attribute.
        assert!(extract("Yes.", "", &ctx).0.is_empty());
        // A phrase matched across sentences: the chunk holding it that the question fits.
        let ctx = vec![
            p("a#0", "Lincoln practised law. It lasted 18 years in all."),
            p("b#0", "Grant served 8 years as president."),
        ];
        let (c, _) = extract("18 years", "How long did Lincoln practise law?", &ctx);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].chunk_id, "a#0");
        // Nothing attributed to a chunk that lacks the answer's words.
        assert!(
            extract("23 years", "How long did Lincoln practise law?", &ctx)
                .0
                .is_empty()
        );
    }

    #[test]
    fn headings_name_the_subject_and_ties_go_to_the_better_ranked_context() {
        let titled = |id: &str, title: &str, text: &str| Passage {
            title: title.into(),
            ..p(id, text)
        };
        let ctx = vec![
            titled("a#0", "Chester A. Arthur", "He had three children."),
            titled("b#0", "Grover Cleveland", "He had five children."),
        ];
        let (c, _) = extract(
            "Five.",
            "How many children did Grover Cleveland have?",
            &ctx,
        );
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].chunk_id, "b#0", "the title names whose children");
        // Two contexts that fit the answer equally: the first (best-ranked) is cited.
        let ctx = vec![
            p("a#0", "Helsinki is the capital of Finland."),
            p("b#0", "Helsinki is the capital of Finland."),
        ];
        let (c, _) = extract("Helsinki", "What is the capital of Finland?", &ctx);
        assert_eq!(c[0].chunk_id, "a#0");
    }

    #[test]
    fn rendering_and_renumbering() {
        let ctx = vec![
            Passage {
                title: "T".into(),
                section: "S".into(),
                ..p("a#0", "one")
            },
            p("b#0", "two"),
        ];
        let (text, n) = render(&ctx);
        assert_eq!(n, 2);
        assert_eq!(
            text,
            "<chunk id=\"1\">T > S\none</chunk>\n<chunk id=\"2\">two</chunk>"
        );
        assert_eq!(
            renumber("x [1] y [2, 1] z [5]", &|n| (n <= 2).then_some(n + 10)),
            "x [11] y [12, 11] z "
        );
        assert_eq!(fill("{a}-{b}-{a}", &[("a", "1"), ("b", "2")]), "1-2-1");
    }
}
