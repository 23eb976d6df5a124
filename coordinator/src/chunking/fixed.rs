//! Fixed-size windows of `size` tokens, consecutive windows sharing `overlap` tokens.

/// `spans`: byte spans of the text's tokens, in order.
pub fn chunk(text: &str, spans: &[(usize, usize)], size: usize, overlap: usize) -> Vec<String> {
    let size = size.max(1);
    let step = size.saturating_sub(overlap).max(1);
    let mut out = Vec::new();
    let mut start = 0;
    while start < spans.len() {
        let end = (start + size).min(spans.len());
        out.push(text[spans[start].0..spans[end - 1].1].to_owned());
        if end == spans.len() {
            break;
        }
        start += step;
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::chunking::{Tokens, WordTokens};

    #[test]
    fn windows_overlap_by_hand() {
        let t = "a b c d e f g";
        let c = super::chunk(t, &WordTokens.spans(t), 3, 1);
        assert_eq!(c, vec!["a b c", "c d e", "e f g"]);
        let c = super::chunk(t, &WordTokens.spans(t), 4, 0);
        assert_eq!(c, vec!["a b c d", "e f g"]);
        assert!(super::chunk("", &[], 3, 1).is_empty());
        // overlap >= size still advances.
        assert_eq!(
            super::chunk("a b", &WordTokens.spans("a b"), 1, 5),
            vec!["a", "b"]
        );
    }
}
