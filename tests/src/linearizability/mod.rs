//! A linearizability checker for per-document histories (Wing and Gong's search with the
//! memoisation of Lowe and of Porcupine): each document is a register that upserts set,
//! deletes clear and STRONG reads observe. A history is linearizable when every operation can
//! be given one instant between its call and its return such that, in that order, every read
//! sees the last write before it. A write whose outcome the client does not know (it failed
//! or timed out) may take effect at any instant after its call, or never: it returns at
//! infinity. Failed reads say nothing and are left out by the recorder.
//!
//! Keys are checked one by one (a register's history is independent of the others'), which
//! keeps each search small: the state space is the set of operations already placed times the
//! register's value, and a (set, value) pair that failed once is never explored again.
//! `recorder` runs the clients whose histories a fault test checks.

pub mod recorder;

use std::collections::HashSet;
use std::fmt;
use std::time::Instant;

/// What an operation did to (or saw in) its document.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Upsert with this content (a version tag unique to the write).
    Put(String),
    Delete,
    /// A STRONG read that saw this content, or no document.
    Read(Option<String>),
}

/// One operation of one client: its call, its return (`None`: outcome unknown), what it did.
#[derive(Debug, Clone)]
pub struct Op {
    pub client: usize,
    pub call: Instant,
    pub ret: Option<Instant>,
    pub kind: Kind,
}

/// Why a history is not linearizable: the longest prefix order found, and the operations
/// that could not be placed after it.
#[derive(Debug)]
pub struct Violation {
    pub placed: Vec<usize>,
    pub stuck: Vec<usize>,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "no linearization: after ops {:?} none of {:?} can come next",
            self.placed, self.stuck
        )
    }
}

/// Checks one document's history (any order of `ops`).
pub fn check(ops: &[Op]) -> Result<(), Violation> {
    let n = ops.len();
    // Returns as offsets on one clock; an unknown outcome returns after everything.
    let origin = ops.iter().map(|o| o.call).min();
    let Some(origin) = origin else {
        return Ok(());
    };
    let at = |t: Instant| t.duration_since(origin).as_nanos();
    let call: Vec<u128> = ops.iter().map(|o| at(o.call)).collect();
    let ret: Vec<u128> = ops.iter().map(|o| o.ret.map_or(u128::MAX, at)).collect();
    let must: usize = ops.iter().filter(|o| o.ret.is_some()).count();
    let mut search = Search {
        ops,
        call,
        ret,
        done: vec![false; n],
        seen: HashSet::new(),
        order: Vec::new(),
        best: Vec::new(),
    };
    if search.dfs(None, must) {
        return Ok(());
    }
    let best = search.best;
    let stuck = (0..n)
        .filter(|i| !best.contains(i) && ops[*i].ret.is_some())
        .collect();
    Err(Violation {
        placed: best,
        stuck,
    })
}

struct Search<'a> {
    ops: &'a [Op],
    call: Vec<u128>,
    ret: Vec<u128>,
    done: Vec<bool>,
    /// (placed set, value) pairs known to lead nowhere.
    seen: HashSet<(Vec<bool>, Option<String>)>,
    order: Vec<usize>,
    best: Vec<usize>,
}

impl Search<'_> {
    /// Places the remaining operations after `value`; true when every operation with a known
    /// return (`must` of them left) is placed.
    fn dfs(&mut self, value: Option<&str>, must: usize) -> bool {
        if must == 0 {
            return true;
        }
        if !self
            .seen
            .insert((self.done.clone(), value.map(str::to_owned)))
        {
            return false;
        }
        if self.order.len() > self.best.len() {
            self.best = self.order.clone();
        }
        // Only an operation called before every pending one returned can come next.
        let horizon = (0..self.ops.len())
            .filter(|i| !self.done[*i])
            .map(|i| self.ret[i])
            .min()
            .unwrap_or(u128::MAX);
        for i in 0..self.ops.len() {
            if self.done[i] || self.call[i] > horizon {
                continue;
            }
            let next: Option<String> = match &self.ops[i].kind {
                Kind::Put(v) => Some(v.clone()),
                Kind::Delete => None,
                Kind::Read(seen) => {
                    if seen.as_deref() != value {
                        continue;
                    }
                    seen.clone()
                }
            };
            self.done[i] = true;
            self.order.push(i);
            let left = must - usize::from(self.ops[i].ret.is_some());
            if self.dfs(next.as_deref(), left) {
                return true;
            }
            self.order.pop();
            self.done[i] = false;
        }
        false
    }
}

/// A printable history, one operation a line in call order, for a failing seed's report.
pub fn render(ops: &[Op]) -> String {
    let Some(origin) = ops.iter().map(|o| o.call).min() else {
        return String::new();
    };
    let ms = |t: Instant| t.duration_since(origin).as_secs_f64() * 1e3;
    let mut idx: Vec<usize> = (0..ops.len()).collect();
    idx.sort_by_key(|i| ops[*i].call);
    idx.iter()
        .map(|&i| {
            let o = &ops[i];
            let ret = o
                .ret
                .map_or("unknown".to_owned(), |r| format!("{:.1} ms", ms(r)));
            format!(
                "  #{i} client {} {:?} from {:.1} ms to {ret}\n",
                o.client,
                o.kind,
                ms(o.call)
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Operations at millisecond offsets from one origin.
    struct H(Instant, Vec<Op>);

    impl H {
        fn new() -> Self {
            Self(Instant::now(), Vec::new())
        }

        fn op(mut self, client: usize, from: u64, to: Option<u64>, kind: Kind) -> Self {
            let t = |ms| self.0 + Duration::from_millis(ms);
            self.1.push(Op {
                client,
                call: t(from),
                ret: to.map(t),
                kind,
            });
            self
        }
    }

    fn put(v: &str) -> Kind {
        Kind::Put(v.into())
    }

    fn read(v: Option<&str>) -> Kind {
        Kind::Read(v.map(Into::into))
    }

    #[test]
    fn sequential_reads_see_the_last_write() {
        let h = H::new()
            .op(0, 0, Some(1), put("a"))
            .op(0, 2, Some(3), read(Some("a")))
            .op(0, 4, Some(5), Kind::Delete)
            .op(0, 6, Some(7), read(None));
        check(&h.1).unwrap();
    }

    #[test]
    fn a_stale_read_after_a_completed_write_is_caught() {
        let h = H::new()
            .op(0, 0, Some(1), put("a"))
            .op(0, 2, Some(3), put("b"))
            .op(1, 4, Some(5), read(Some("a")));
        let v = check(&h.1).unwrap_err();
        assert!(v.stuck.contains(&2), "{v}");
    }

    #[test]
    fn a_read_concurrent_with_a_write_may_see_either_value() {
        for seen in [Some("a"), Some("b")] {
            let h = H::new()
                .op(0, 0, Some(1), put("a"))
                .op(0, 2, Some(10), put("b"))
                .op(1, 3, Some(4), read(seen));
            check(&h.1).unwrap();
        }
    }

    #[test]
    fn reads_cannot_go_back_once_one_saw_the_new_value() {
        // Both reads overlap the write, but the second starts after the first returned "b":
        // it cannot see "a" again.
        let h = H::new()
            .op(0, 0, Some(1), put("a"))
            .op(0, 2, Some(20), put("b"))
            .op(1, 3, Some(4), read(Some("b")))
            .op(2, 5, Some(6), read(Some("a")));
        check(&h.1).unwrap_err();
    }

    #[test]
    fn a_write_of_unknown_outcome_may_have_happened_or_not() {
        let h = H::new()
            .op(0, 0, Some(1), put("a"))
            .op(0, 2, None, put("b"))
            .op(1, 5, Some(6), read(Some("b")))
            .op(1, 7, Some(8), read(Some("b")));
        check(&h.1).unwrap();
        let h = H::new()
            .op(0, 0, Some(1), put("a"))
            .op(0, 2, None, put("b"))
            .op(1, 5, Some(6), read(Some("a")));
        check(&h.1).unwrap();
        // But once seen, it cannot be undone.
        let h = H::new()
            .op(0, 0, Some(1), put("a"))
            .op(0, 2, None, put("b"))
            .op(1, 5, Some(6), read(Some("b")))
            .op(1, 7, Some(8), read(Some("a")));
        check(&h.1).unwrap_err();
    }

    #[test]
    fn a_resurrected_delete_is_caught() {
        let h = H::new()
            .op(0, 0, Some(1), put("a"))
            .op(0, 2, Some(3), Kind::Delete)
            .op(1, 4, Some(5), read(Some("a")));
        check(&h.1).unwrap_err();
    }

    #[test]
    fn a_value_never_written_is_caught() {
        let h = H::new().op(0, 0, Some(1), read(Some("ghost")));
        check(&h.1).unwrap_err();
    }

    #[test]
    fn many_concurrent_clients_stay_fast() {
        // 8 clients, 12 overlapping operations each: the memo keeps the search small.
        let mut h = H::new();
        for c in 0..8u64 {
            for k in 0..12u64 {
                let from = k * 10 + c;
                let kind = if c % 2 == 0 {
                    put(&format!("v{c}-{k}"))
                } else {
                    read(None)
                };
                h = h.op(c as usize, from, Some(from + 15), kind);
            }
        }
        // Reads of "nothing" overlap the first writes only at the start; later ones are
        // stale: the search must end with a violation, not explore every order.
        assert!(check(&h.1).is_err());
    }
}
