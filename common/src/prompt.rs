//! The generation prompt's building blocks, shared by the coordinator's flows and by
//! `ragctl eval answers --oracle`, so the oracle-paragraph reader is asked exactly as the
//! default flow asks: the same system prompt, template, chunk tags and stop string. Worked
//! examples (few-shot turns) are asked the same way where a flow names some.

use ragcluster_proto::v1::ChatMessage;

/// Context first, the instruction and question last (SmolLM2-135M echoed the prompt when the
/// question came right after the chunks). No request to cite: asked to "cite the chunk
/// numbers like [1]", Qwen2.5-Coder-0.5B answered nothing but "[1]" (as candle's reference
/// implementation of the model does); the answer is attributed to the chunks by word overlap
/// instead (`flow::citations`). On 24 CMU QA questions given their gold paragraph this
/// wording took the 0.5B model from yes/no accuracy 0.00 to 0.85 and short-answer token F1
/// from 0.10 to 0.50 (docs/evaluation.md, "Choosing the generator").
pub const DEFAULT_SYSTEM: &str = "You are a helpful assistant.";
pub const DEFAULT_PROMPT: &str =
    "{contexts}\n\nAnswer using only the context, with a short phrase.\nQuestion: {question}";
/// Generation stops here by default: a small model may go on to invent the next question.
pub const DEFAULT_STOP: &str = "\nQuestion:";

/// One context as the seeds' chunk-tagged prompt shows it:
/// `<chunk id="n">title > section\ntext</chunk>` (empty title or section left out).
pub fn chunk_tag(number: usize, title: &str, section: &str, text: &str) -> String {
    let label = match (title.is_empty(), section.is_empty()) {
        (true, true) => String::new(),
        (false, true) => format!("{title}\n"),
        (true, false) => format!("{section}\n"),
        (false, false) => format!("{title} > {section}\n"),
    };
    format!("<chunk id=\"{number}\">{label}{}</chunk>\n", text.trim())
}

/// A worked example shown to the generator before the real question (few-shot prompting): the
/// example is asked through the same template and chunk tag as the question, and its answer is
/// the assistant's earlier reply, so a small model sees the length and form of answer wanted.
/// None by default: on CMU QA they made answers terser (exact match up) but cost yes/no
/// accuracy, citations and latency (docs/evaluation.md, "Worked examples").
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Example {
    pub title: String,
    pub context: String,
    pub question: String,
    pub answer: String,
}

/// Worked examples as the chat turns that precede the question: each example's user turn
/// (`template` filled with its context and question), then its answer as the assistant's.
pub fn example_turns(template: &str, examples: &[Example]) -> Vec<ChatMessage> {
    let turn = |role: &str, content: String| ChatMessage {
        role: role.into(),
        content,
    };
    examples
        .iter()
        .flat_map(|e| {
            [
                turn("user", e.user_turn(template)),
                turn("assistant", e.answer.clone()),
            ]
        })
        .collect()
}

impl Example {
    /// The example's user turn: `template` filled as the real question's prompt is.
    pub fn user_turn(&self, template: &str) -> String {
        let contexts = chunk_tag(1, &self.title, "", &self.context);
        fill(
            template,
            &[
                ("contexts", contexts.trim_end()),
                ("question", &self.question),
                ("query", &self.question),
            ],
        )
    }
}

/// The beginnings a yes/no answer is held to (`GenerateRequest.starts_with`).
pub const YES_NO_STARTS: [&str; 2] = ["Yes", "No"];
/// The largest `GenerateRequest.starts_bias` either way (OpenAI's `logit_bias` range): the
/// model worker refuses more, the coordinator's calibration clamps to it.
pub const MAX_START_BIAS: f32 = 100.0;

/// Auxiliary and modal verbs that open an English polar (yes/no) question.
const POLAR_OPENERS: &[&str] = &[
    "is",
    "are",
    "was",
    "were",
    "am",
    "do",
    "does",
    "did",
    "can",
    "could",
    "has",
    "have",
    "had",
    "will",
    "would",
    "should",
    "shall",
    "may",
    "might",
    "must",
    "isn't",
    "aren't",
    "wasn't",
    "weren't",
    "don't",
    "doesn't",
    "didn't",
    "can't",
    "couldn't",
    "hasn't",
    "haven't",
    "hadn't",
    "won't",
    "wouldn't",
    "shouldn't",
];

/// Whether a question reads as a yes/no question: its first word, or the first after a
/// short opening clause ("In 1796, was ..."), is an auxiliary or modal verb. Grammar only,
/// no model: on the 1,397 CMU QA questions it marks 653 of the 659 yes/no ones and 11 others
/// (mostly "A or B?" choices).
pub fn is_yes_no_question(question: &str) -> bool {
    let opens = |s: &str| {
        s.split_whitespace().next().is_some_and(|w| {
            let w: String = w
                .chars()
                .filter(|c| c.is_alphabetic() || *c == '\'')
                .collect::<String>()
                .to_lowercase();
            POLAR_OPENERS.contains(&w.as_str())
        })
    };
    let q = question.trim();
    opens(q)
        || q.split_once(',')
            .is_some_and(|(head, rest)| head.split_whitespace().count() <= 6 && opens(rest))
}

/// Replaces `{name}` placeholders.
pub fn fill(template: &str, vars: &[(&str, &str)]) -> String {
    let mut out = template.to_owned();
    for (k, v) in vars {
        out = out.replace(&format!("{{{k}}}"), v);
    }
    out
}

/// The citation markers of an answer (`[2]`, `[1, 3]`, `[chunk 2]`): the numbers each names
/// and its byte range. Shared by the coordinator's citation check and `ragctl eval answers`,
/// which scores answers without them.
pub fn citation_markers(answer: &str) -> Vec<(Vec<u32>, usize, usize)> {
    let b = answer.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'['
            && let Some(len) = answer[i + 1..].find(']')
        {
            let inner = &answer[i + 1..i + 1 + len];
            let inner = inner.trim().trim_start_matches("chunk").trim();
            let nums: Option<Vec<u32>> = inner
                .split(',')
                .map(|p| p.trim().parse::<u32>().ok())
                .collect();
            if let Some(nums) = nums.filter(|n| !n.is_empty() && len <= 24) {
                out.push((nums, i, i + len + 2));
                i += len + 2;
                continue;
            }
        }
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yes_no_questions_are_told_by_their_verb() {
        for q in [
            "Was Abraham Lincoln the sixteenth President?",
            "Didn't he win?",
            "In 1796, was Lombardy ruled by Austria?",
            "  does it rain ",
        ] {
            assert!(is_yes_no_question(q), "{q}");
        }
        for q in [
            "When was he elected?",
            "Who is it?",
            "",
            "How many, if any, were there?",
            "Isaac Newton was born when?",
        ] {
            assert!(!is_yes_no_question(q), "{q}");
        }
    }

    #[test]
    fn tags_and_placeholders() {
        assert_eq!(
            chunk_tag(2, "Raft", "Election", " text "),
            "<chunk id=\"2\">Raft > Election\ntext</chunk>\n"
        );
        assert_eq!(chunk_tag(1, "", "", "t"), "<chunk id=\"1\">t</chunk>\n");
        assert_eq!(
            fill("{a} and {b} and {a}", &[("a", "x"), ("b", "y")]),
            "x and y and x"
        );
    }

    #[test]
    fn an_example_is_asked_as_the_question_is() {
        let e = Example {
            title: "Raft".into(),
            context: "Raft elects a leader.".into(),
            question: "What does Raft elect?".into(),
            answer: "A leader".into(),
        };
        assert_eq!(
            e.user_turn(DEFAULT_PROMPT),
            "<chunk id=\"1\">Raft\nRaft elects a leader.</chunk>\n\nAnswer using only the context, \
             with a short phrase.\nQuestion: What does Raft elect?"
        );
    }
}
