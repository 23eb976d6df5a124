//! Markdown structure-aware chunking: the document is cut at headings (ATX and setext, as
//! CommonMark parses them, so `#` inside code blocks is not a heading), each section's body is
//! packed by sentences, and every chunk carries its heading path "H1 > H2 > H3".

use pulldown_cmark::{Event, HeadingLevel, Parser, Tag, TagEnd};

use super::{ChunkParams, ChunkText, Tokens, sentence};

struct Heading {
    level: usize,
    title: String,
    /// Byte range of the heading line(s) in the source.
    start: usize,
    end: usize,
}

fn headings(text: &str) -> Vec<Heading> {
    let mut out = Vec::new();
    let mut cur: Option<Heading> = None;
    for (ev, range) in Parser::new(text).into_offset_iter() {
        match ev {
            Event::Start(Tag::Heading { level, .. }) => {
                let level = match level {
                    HeadingLevel::H1 => 1,
                    HeadingLevel::H2 => 2,
                    HeadingLevel::H3 => 3,
                    HeadingLevel::H4 => 4,
                    HeadingLevel::H5 => 5,
                    HeadingLevel::H6 => 6,
                };
                cur = Some(Heading {
                    level,
                    title: String::new(),
                    start: range.start,
                    end: range.end,
                });
            }
            Event::Text(t) | Event::Code(t) => {
                if let Some(h) = cur.as_mut() {
                    h.title.push_str(&t);
                }
            }
            Event::End(TagEnd::Heading(_)) => {
                if let Some(mut h) = cur.take() {
                    h.title = h.title.trim().to_owned();
                    out.push(h);
                }
            }
            _ => {}
        }
    }
    out
}

pub fn chunk(text: &str, tok: &dyn Tokens, p: &ChunkParams) -> Vec<ChunkText> {
    let hs = headings(text);
    let mut out = Vec::new();
    let mut path: Vec<(usize, String)> = Vec::new();
    let emit = |body: &str, path: &[(usize, String)], out: &mut Vec<ChunkText>| {
        let section = path
            .iter()
            .map(|(_, t)| t.as_str())
            .collect::<Vec<_>>()
            .join(" > ");
        for c in sentence::chunk(body, &tok.spans(body), p) {
            out.push(ChunkText {
                text: c,
                section: section.clone(),
            });
        }
    };
    let first = hs.first().map_or(text.len(), |h| h.start);
    emit(&text[..first], &path, &mut out);
    for (i, h) in hs.iter().enumerate() {
        while path.last().is_some_and(|(l, _)| *l >= h.level) {
            path.pop();
        }
        path.push((h.level, h.title.clone()));
        let body_end = hs.get(i + 1).map_or(text.len(), |n| n.start);
        emit(&text[h.end.min(body_end)..body_end], &path, &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::chunking::{ChunkParams, Strategy, WordTokens};

    #[test]
    fn keeps_heading_paths() {
        let md = "Intro words here.\n\n# Install\n\nRun the script.\n\n## Linux\n\nUse apt.\n\n```\n# not a heading\n```\n\n# Usage\n\nCall it.\n";
        let p = ChunkParams {
            strategy: Strategy::Markdown,
            chunk_size: 50,
            overlap: 0,
            min_tokens: 0,
        };
        let c = super::chunk(md, &WordTokens, &p);
        let got: Vec<(&str, &str)> = c
            .iter()
            .map(|c| (c.section.as_str(), c.text.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("", "Intro words here."),
                ("Install", "Run the script."),
                ("Install > Linux", "Use apt.\n\n```\n# not a heading\n```"),
                ("Usage", "Call it."),
            ]
        );
    }
}
