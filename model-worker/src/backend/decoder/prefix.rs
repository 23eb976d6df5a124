//! The prefix cache: keys and values of recent sequences, kept when their streams end, so that
//! a new prompt that begins the same way starts from the cached positions instead of running
//! them through the model again. RAG prompts share long beginnings: a flow's system prompt and
//! worked examples, the instructions of a rewrite step, a chat's earlier turns (kept with the
//! reply, so the next turn reuses both). On two CPU cores every prompt token costs
//! milliseconds of prefill; a copy of its cached keys and values costs microseconds.
//!
//! Entries are whole sequences (prompt and reply tokens with their cache) and what the model
//! answered right after the prompt (its first pick, or the logits it was picked from). A lookup
//! takes the longest common prefix with any of them. A prompt asked again whole reuses that
//! answer too, so it decodes exactly as the first asking did; any other prompt computes at least
//! its last token (its logits pick the first reply token), and the positions it reads from the
//! cache were computed in other forwards than its own prefill would compute them in, which moves
//! its logits in their last digits (as batching with other streams does). The budget is in
//! bytes, least recently used entries go first. The CPU decoder only: the GPU's paged cache
//! would share pages instead.

use super::Sampled;
use super::batch::KvCache;

/// The decoder's answer right after a prompt of `at` tokens.
#[derive(Clone)]
pub struct FirstPick {
    pub at: usize,
    pub out: Sampled,
}

impl FirstPick {
    /// Whether it serves a request: logits serve any, a greedy pick only a greedy request.
    fn serves(&self, greedy: bool) -> bool {
        greedy || matches!(self.out, Sampled::Logits(_))
    }

    fn bytes(&self) -> usize {
        match &self.out {
            Sampled::Logits(l) => l.len() * std::mem::size_of::<f32>(),
            Sampled::Token { .. } => 0,
        }
    }
}

/// One kept sequence.
struct Entry {
    tokens: Vec<u32>,
    kv: KvCache,
    first: Option<FirstPick>,
    /// Value of `PrefixCache::clock` when last kept or hit.
    used: u64,
}

impl Entry {
    fn bytes(&self) -> usize {
        self.kv.bytes() + self.first.as_ref().map_or(0, FirstPick::bytes)
    }

    /// Whether this entry holds everything `other` would: its tokens, and its first pick.
    fn covers(&self, tokens: &[u32], first: Option<&FirstPick>) -> bool {
        self.tokens.starts_with(tokens)
            && first.is_none_or(|f| self.first.as_ref().is_some_and(|g| g.at == f.at))
    }
}

/// What a lookup found: the cached positions, and the first pick when the prompt was asked
/// whole before (then every prompt position is cached).
pub struct Hit {
    pub kv: KvCache,
    pub first: Option<Sampled>,
}

pub struct PrefixCache {
    budget: usize,
    used_bytes: usize,
    clock: u64,
    entries: Vec<Entry>,
}

/// Length of the common beginning of two token sequences.
fn common(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PrefixCache {
    /// A cache of at most `budget` bytes of keys and values (0: off).
    pub fn new(budget: usize) -> Self {
        Self {
            budget,
            used_bytes: 0,
            clock: 0,
            entries: Vec::new(),
        }
    }

    /// Whether anything is ever kept (a budget above 0).
    pub fn is_on(&self) -> bool {
        self.budget > 0
    }

    /// Bytes held now.
    pub fn bytes(&self) -> usize {
        self.used_bytes
    }

    /// The longest cached beginning of `prompt`: all of it with the first pick when it was
    /// asked whole before (and that pick serves a `greedy` request or not), else at most all but
    /// its last token; None when no entry shares a first token with it.
    pub fn take(&mut self, prompt: &[u32], greedy: bool) -> Option<Hit> {
        let whole = |e: &Entry| {
            e.first
                .as_ref()
                .filter(|f| f.at == prompt.len() && f.serves(greedy) && e.kv.len() >= f.at)
                .is_some_and(|_| e.tokens.starts_with(prompt))
        };
        let most = prompt.len().saturating_sub(1);
        let (best, n, repeat) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| match whole(e) {
                true => (i, prompt.len(), true),
                false => (
                    i,
                    common(&e.tokens, prompt).min(most).min(e.kv.len()),
                    false,
                ),
            })
            .max_by_key(|&(i, n, _)| (n, std::cmp::Reverse(i)))?;
        if n == 0 {
            return None;
        }
        self.clock += 1;
        let e = &mut self.entries[best];
        e.used = self.clock;
        Some(Hit {
            kv: e.kv.head(n),
            first: repeat
                .then(|| e.first.as_ref().map(|f| f.out.clone()))
                .flatten(),
        })
    }

    /// Keeps a finished sequence: `tokens` are those whose keys and values `kv` holds (any
    /// beyond `kv.len()` are dropped: the last sampled token is never run), `first` what the
    /// decoder answered after its prompt. A sequence an entry already holds (tokens and first
    /// pick) is not kept twice; one that holds an entry replaces it.
    pub fn keep(&mut self, mut tokens: Vec<u32>, mut kv: KvCache, first: Option<FirstPick>) {
        if self.budget == 0 || kv.is_empty() || tokens.len() < kv.len() {
            return;
        }
        tokens.truncate(kv.len());
        let first = first.filter(|f| f.at <= tokens.len());
        self.clock += 1;
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|e| e.covers(&tokens, first.as_ref()))
        {
            e.used = self.clock;
            return;
        }
        kv.shrink();
        let entry = Entry {
            tokens,
            kv,
            first,
            used: self.clock,
        };
        let bytes = entry.bytes();
        if bytes > self.budget {
            return;
        }
        let mut freed = 0;
        self.entries.retain(|e| {
            let covered = entry.covers(&e.tokens, e.first.as_ref());
            if covered {
                freed += e.bytes();
            }
            !covered
        });
        self.used_bytes -= freed;
        while self.used_bytes + bytes > self.budget {
            let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].used) else {
                break;
            };
            self.used_bytes -= self.entries.swap_remove(oldest).bytes();
        }
        self.used_bytes += bytes;
        self.entries.push(entry);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache of `tokens.len()` positions of 2 layers x 4 floats whose values name the
    /// position's token, so a copied head shows which positions it came from.
    fn kv_of(tokens: &[u32]) -> KvCache {
        let layer: Vec<f32> = tokens.iter().flat_map(|&t| [t as f32; 4]).collect();
        KvCache {
            k: vec![layer.clone(); 2],
            v: vec![layer; 2],
            len: tokens.len(),
        }
    }

    fn tokens_of(kv: &KvCache) -> Vec<u32> {
        kv.k[0].chunks(4).map(|p| p[0] as u32).collect()
    }

    #[test]
    fn longest_beginning_is_reused_but_never_the_last_token() {
        let mut c = PrefixCache::new(1 << 20);
        assert!(c.take(&[1, 2, 3], true).is_none());
        let a = vec![1, 2, 3, 4, 5, 6];
        c.keep(a.clone(), kv_of(&a), None);
        let b = vec![1, 2, 9, 9];
        c.keep(b.clone(), kv_of(&b), None);

        let hit = c.take(&[1, 2, 3, 4, 7, 8], true).unwrap();
        assert_eq!(hit.kv.len(), 4);
        assert!(hit.first.is_none());
        assert_eq!(tokens_of(&hit.kv), vec![1, 2, 3, 4]);
        assert_eq!(hit.kv.k[1].len(), 16);
        // The same prompt again: all but its last token.
        assert_eq!(c.take(&a, true).unwrap().kv.len(), 5);
        // Longer than the entry: the entry's whole length.
        assert_eq!(c.take(&[1, 2, 3, 4, 5, 6, 7, 8], true).unwrap().kv.len(), 6);
        assert_eq!(
            tokens_of(&c.take(&[1, 2, 9, 9, 9], true).unwrap().kv),
            vec![1, 2, 9, 9]
        );
        assert!(c.take(&[5, 1, 2], true).is_none());
        assert!(
            c.take(&[1], true).is_none(),
            "a one-token prompt computes its token"
        );
    }

    #[test]
    fn a_prompt_asked_whole_again_reuses_its_first_pick() {
        let mut c = PrefixCache::new(1 << 20);
        let prompt = vec![1, 2, 3, 4];
        let asked: Vec<u32> = prompt.iter().copied().chain([7, 8]).collect();
        let pick = Sampled::Token {
            token: 7,
            logprob: -0.5,
        };
        let first = |out: &Sampled| {
            Some(FirstPick {
                at: 4,
                out: out.clone(),
            })
        };
        c.keep(asked.clone(), kv_of(&asked[..5]), first(&pick));
        // The same prompt, greedy: every position and the pick.
        let hit = c.take(&prompt, true).unwrap();
        assert_eq!((hit.kv.len(), hit.first), (4, Some(pick.clone())));
        // Sampled, the greedy pick does not serve: all but the last token, computed again.
        let hit = c.take(&prompt, false).unwrap();
        assert_eq!((hit.kv.len(), hit.first), (3, None));
        // A longer or a shorter prompt has no pick of its own here.
        assert_eq!(c.take(&asked[..5], true).unwrap().kv.len(), 4);
        assert!(c.take(&prompt[..3], true).unwrap().first.is_none());
        // Logits serve a sampled request too, and count in the budget.
        let logits = Sampled::Logits(vec![0.0; 100]);
        let other = vec![5, 6, 7];
        c.keep(
            other.clone(),
            kv_of(&other),
            Some(FirstPick {
                at: 3,
                out: logits.clone(),
            }),
        );
        assert_eq!(c.take(&other, false).unwrap().first, Some(logits));
        // 64 bytes a position (2 layers x (k, v) x 4 floats), 400 of logits.
        assert_eq!(c.bytes(), (5 + 3) * 64 + 400);
        // The same tokens kept again with a pick at another length are kept beside.
        c.keep(
            asked.clone(),
            kv_of(&asked[..5]),
            Some(FirstPick {
                at: 5,
                out: pick.clone(),
            }),
        );
        assert_eq!(c.entries.len(), 3);
        assert_eq!(c.take(&prompt, true).unwrap().first, Some(pick));
    }

    #[test]
    fn entries_are_not_kept_twice_and_the_budget_evicts_the_least_recent() {
        let entry = 2 * 2 * 4 * 4 * 10; // layers x (k, v) x floats x bytes x positions
        let mut c = PrefixCache::new(2 * entry);
        let a: Vec<u32> = (0..10).collect();
        c.keep(a.clone(), kv_of(&a), None);
        // A beginning of a kept sequence adds nothing; an extension replaces it.
        c.keep(a[..6].to_vec(), kv_of(&a[..6]), None);
        assert_eq!(c.entries.len(), 1);
        assert_eq!(c.bytes(), entry);
        let longer: Vec<u32> = (0..10).chain([42]).collect();
        c.keep(longer.clone(), kv_of(&longer[..10]), None);
        assert_eq!(c.entries.len(), 1);
        assert_eq!(c.entries[0].tokens, a, "the unrun last token is dropped");

        let b: Vec<u32> = (100..110).collect();
        c.keep(b.clone(), kv_of(&b), None);
        assert_eq!(c.bytes(), 2 * entry);
        // a is used again, so b is the least recent when a third sequence arrives.
        assert!(c.take(&[0, 1, 2], true).is_some());
        let d: Vec<u32> = (200..210).collect();
        c.keep(d.clone(), kv_of(&d), None);
        assert_eq!(c.bytes(), 2 * entry);
        assert!(c.take(&[100, 101, 102], true).is_none(), "b was evicted");
        assert!(c.take(&[0, 1, 2], true).is_some() && c.take(&[200, 201, 202], true).is_some());

        // Off, or a sequence larger than the whole budget: nothing kept.
        let mut off = PrefixCache::new(0);
        off.keep(a.clone(), kv_of(&a), None);
        assert!(off.take(&a, true).is_none());
        let mut small = PrefixCache::new(entry - 1);
        small.keep(a.clone(), kv_of(&a), None);
        assert_eq!(small.bytes(), 0);
    }
}
