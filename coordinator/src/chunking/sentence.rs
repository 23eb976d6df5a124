//! Sentence packing: sentences (Unicode UAX #29 boundaries) are packed greedily into chunks of
//! at most `chunk_size` tokens; a sentence longer than that is cut into fixed windows; a chunk
//! shorter than `min_tokens` is merged into its predecessor.

use unicode_segmentation::UnicodeSegmentation;

use super::ChunkParams;

/// `spans`: byte spans of the text's tokens. Returns verbatim slices of `text`.
pub fn chunk(text: &str, spans: &[(usize, usize)], p: &ChunkParams) -> Vec<String> {
    // Token index ranges [a, b) of each sentence.
    let mut sentences: Vec<(usize, usize)> = Vec::new();
    let mut ti = 0;
    for (off, s) in text.split_sentence_bound_indices() {
        let end = off + s.len();
        let a = ti;
        while ti < spans.len() && spans[ti].0 < end {
            ti += 1;
        }
        if ti > a {
            sentences.push((a, ti));
        }
    }
    let size = p.chunk_size.max(1);
    // Pack into token ranges.
    let mut ranges: Vec<(usize, usize)> = Vec::new();
    let mut cur: Option<(usize, usize)> = None;
    for (a, b) in sentences {
        if b - a > size {
            if let Some(c) = cur.take() {
                ranges.push(c);
            }
            let step = size.saturating_sub(p.overlap).max(1);
            let mut s = a;
            while s < b {
                let e = (s + size).min(b);
                ranges.push((s, e));
                if e == b {
                    break;
                }
                s += step;
            }
            continue;
        }
        cur = match cur {
            Some((ca, _)) if b - ca <= size => Some((ca, b)),
            Some(c) => {
                ranges.push(c);
                Some((a, b))
            }
            None => Some((a, b)),
        };
    }
    ranges.extend(cur);
    // Merge short chunks into the previous one.
    let mut merged: Vec<(usize, usize)> = Vec::new();
    for r in ranges {
        match merged.last_mut() {
            Some(last) if r.1 - r.0 < p.min_tokens && r.0 <= last.1 => last.1 = last.1.max(r.1),
            _ => merged.push(r),
        }
    }
    if merged.len() > 1 && merged[0].1 - merged[0].0 < p.min_tokens {
        let first = merged.remove(0);
        merged[0].0 = first.0;
    }
    merged
        .into_iter()
        .map(|(a, b)| text[spans[a].0..spans[b - 1].1].to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::chunking::{ChunkParams, Strategy, Tokens, WordTokens};

    fn p(size: usize, min: usize) -> ChunkParams {
        ChunkParams {
            strategy: Strategy::Sentence,
            chunk_size: size,
            overlap: 0,
            min_tokens: min,
        }
    }

    #[test]
    fn packs_sentences_up_to_size() {
        let t = "One two three. Four five. Six seven eight nine. Ten.";
        let c = super::chunk(t, &WordTokens.spans(t), &p(5, 0));
        assert_eq!(
            c,
            vec!["One two three. Four five.", "Six seven eight nine. Ten."]
        );
    }

    #[test]
    fn merges_short_and_splits_long() {
        let t = "A b c d. E. F g h i j k l m n o.";
        let c = super::chunk(t, &WordTokens.spans(t), &p(4, 2));
        // "A b c d." fits; "E." (1 token < 2) merges into it; the 10-token sentence is cut in
        // windows of 4, and its 2-token tail stays (not shorter than min).
        assert_eq!(c, vec!["A b c d. E.", "F g h i", "j k l m", "n o."]);
    }
}
