//! Checks across steps and flows: route targets exist, flows reference each other without
//! cycles, and every step's input is produced by an earlier step.

use std::collections::BTreeSet;

use super::*;

/// What a simple operator reads and the hint when it is missing.
fn needs(op: &Op) -> Option<(Slot, &'static str)> {
    const CHUNKS: &str = "add bm25, dense or hybrid before it";
    match op {
        Op::Rerank { .. }
        | Op::Mmr { .. }
        | Op::PrevNext { .. }
        | Op::Threshold { .. }
        | Op::Compress { .. }
        | Op::Reorder(_)
        | Op::Prompt { .. } => Some((Slot::Chunks, CHUNKS)),
        Op::Generate(_) => Some((Slot::Prompt, "add a prompt step before it")),
        Op::Verify { .. } => Some((Slot::Answer, "verify checks a generated answer")),
        Op::Judge {
            rule: JudgeRule::MinScore,
            ..
        } => Some((Slot::Chunks, "min_score judges chunks")),
        Op::Judge { .. } => Some((Slot::Answer, "this rule judges a generated answer")),
        Op::Fuse { .. } => Some((
            Slot::Branches,
            "fuse merges the results of a branch or recurse step",
        )),
        Op::Active { .. } => Some((
            Slot::Chunks,
            "active generation starts from retrieved chunks",
        )),
        Op::Branch {
            over: BranchOver::Queries,
            ..
        } => Some((
            Slot::Queries,
            "add multi_query, decompose or step_back before it",
        )),
        Op::Branch { .. } => Some((Slot::Chunks, CHUNKS)),
        _ => None,
    }
}

/// What a simple operator adds (and, for fuse, takes away).
fn produces(op: &Op, have: &mut BTreeSet<Slot>) {
    match op {
        Op::MultiQuery { .. } | Op::Decompose { .. } | Op::StepBack(_) => {
            have.insert(Slot::Queries);
        }
        Op::Retrieve(_) => {
            have.insert(Slot::Chunks);
        }
        Op::Prompt { .. } => {
            have.insert(Slot::Prompt);
        }
        Op::Generate(_) => {
            have.insert(Slot::Answer);
        }
        Op::Judge { .. } => {
            have.insert(Slot::Verdict);
        }
        Op::Fuse { method, .. } => {
            have.remove(&Slot::Branches);
            have.insert(Slot::Chunks);
            if *method != FuseMethod::Rrf {
                have.insert(Slot::Answer);
                have.insert(Slot::Prompt);
            }
        }
        Op::Active { .. } => {
            have.insert(Slot::Answer);
            have.insert(Slot::Prompt);
        }
        _ => {}
    }
}

/// Flows named by route steps, at any depth.
fn referenced(steps: &[Step]) -> Vec<String> {
    let mut out = Vec::new();
    for s in steps {
        match &s.op {
            Op::Route {
                routes, default, ..
            } => {
                out.extend(routes.iter().map(|r| r.flow.clone()));
                if !default.is_empty() {
                    out.push(default.clone());
                }
            }
            Op::Branch { steps, .. } | Op::Loop { steps, .. } | Op::Recurse { steps, .. } => {
                out.extend(referenced(steps))
            }
            _ => {}
        }
    }
    out
}

/// Every flow a route step may go to (its routes, then its default).
fn targets<'a>(routes: &'a [RouteTarget], default: &'a String) -> impl Iterator<Item = &'a String> {
    routes
        .iter()
        .map(|r| &r.flow)
        .chain(std::iter::once(default).filter(|d| !d.is_empty()))
}

impl FlowSet {
    /// Parses and validates a flow file.
    pub fn parse(text: &str) -> SpecResult<Self> {
        let set = lower::parse_file(text)?;
        set.validate()?;
        Ok(set)
    }

    /// The flow for a request: the named one, else the collection's default, else the file's.
    pub fn resolve(&self, name: &str, collection: &str) -> SpecResult<&Flow> {
        let n = if !name.is_empty() {
            name
        } else if let Some(f) = self.collections.get(collection) {
            f
        } else {
            &self.default
        };
        self.flows.get(n).ok_or_else(|| {
            format!(
                "flow {n:?} is not defined (flows: {})",
                self.flows.keys().cloned().collect::<Vec<_>>().join(", ")
            )
        })
    }

    fn validate(&self) -> SpecResult<()> {
        if self.flows.is_empty() {
            return Err("flow file: no flows".into());
        }
        if !self.default.is_empty() && !self.flows.contains_key(&self.default) {
            return Err(format!(
                "flow file: default flow {:?} is not defined",
                self.default
            ));
        }
        for (c, f) in &self.collections {
            if !self.flows.contains_key(f) {
                return Err(format!("collections.{c}: flow {f:?} is not defined"));
            }
        }
        for f in self.flows.values() {
            self.check_routes(&f.steps)?;
        }
        for f in self.flows.values() {
            self.find_cycle(&f.name, &mut Vec::new())?;
        }
        for f in self.flows.values() {
            self.walk(&f.steps, BTreeSet::new())?;
        }
        Ok(())
    }

    /// Validates a single flow against this set (inline flows of a request).
    pub fn validate_inline(&self, f: &Flow) -> SpecResult<()> {
        self.check_routes(&f.steps)?;
        for name in referenced(&f.steps) {
            self.find_cycle(&name, &mut vec![f.name.clone()])?;
        }
        self.walk(&f.steps, BTreeSet::new())?;
        Ok(())
    }

    fn check_routes(&self, steps: &[Step]) -> SpecResult<()> {
        for s in steps {
            match &s.op {
                Op::Route {
                    routes, default, ..
                } => {
                    if let Some(t) = targets(routes, default).find(|t| !self.flows.contains_key(*t))
                    {
                        return Err(format!(
                            "{}: route target flow {t:?} is not defined",
                            s.place
                        ));
                    }
                }
                Op::Branch { steps, .. } | Op::Loop { steps, .. } | Op::Recurse { steps, .. } => {
                    self.check_routes(steps)?
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn find_cycle(&self, name: &str, path: &mut Vec<String>) -> SpecResult<()> {
        if let Some(i) = path.iter().position(|p| p == name) {
            let mut cycle = path[i..].to_vec();
            cycle.push(name.to_owned());
            return Err(format!(
                "flows {}: a cycle without a loop bound (use a loop step with max_iterations)",
                cycle.join(" -> ")
            ));
        }
        let Some(f) = self.flows.get(name) else {
            return Ok(());
        };
        path.push(name.to_owned());
        for next in referenced(&f.steps) {
            self.find_cycle(&next, path)?;
        }
        path.pop();
        Ok(())
    }

    /// Walks the steps with the set of defined slots; fails at the first missing input.
    fn walk(&self, steps: &[Step], mut have: BTreeSet<Slot>) -> SpecResult<BTreeSet<Slot>> {
        for (i, s) in steps.iter().enumerate() {
            if let Some((slot, hint)) = needs(&s.op)
                && !have.contains(&slot)
            {
                return Err(format!(
                    "{}: input {:?} is not produced by any earlier step ({hint})",
                    s.place,
                    slot.name()
                ));
            }
            have = self.control(steps, i, have)?;
            produces(&s.op, &mut have);
        }
        Ok(have)
    }

    /// What control operators (and verify) do to the slots beyond their own inputs.
    fn control(
        &self,
        steps: &[Step],
        i: usize,
        have: BTreeSet<Slot>,
    ) -> SpecResult<BTreeSet<Slot>> {
        let s = &steps[i];
        match &s.op {
            Op::Verify { .. } if !steps[..i].iter().any(|p| matches!(p.op, Op::Retrieve(_))) => {
                Err(format!(
                    "{}: verify widens the retrieval of its own step list, which has none",
                    s.place
                ))
            }
            Op::Route {
                routes, default, ..
            } => {
                // After a route, only what every target produces is certain.
                let mut out: Option<BTreeSet<Slot>> = None;
                for t in targets(routes, default) {
                    let got = self.walk(&self.flows[t].steps, have.clone())?;
                    out = Some(match out {
                        None => got,
                        Some(o) => o.intersection(&got).copied().collect(),
                    });
                }
                Ok(out.unwrap_or(have))
            }
            Op::Branch { over, steps, .. } => {
                let mut inner = have.clone();
                if *over == BranchOver::Chunks {
                    inner.insert(Slot::Chunks);
                }
                self.walk(steps, inner)?;
                let mut have = have;
                have.insert(Slot::Branches);
                Ok(have)
            }
            Op::Loop { steps, .. } => self.walk(steps, have),
            Op::Recurse { steps, .. } => {
                let got = self.walk(steps, have.clone())?;
                if !got.contains(&Slot::Answer) {
                    return Err(format!(
                        "{}: the steps of a recursion must generate an answer",
                        s.place
                    ));
                }
                let mut have = have;
                have.insert(Slot::Branches);
                Ok(have)
            }
            _ => Ok(have),
        }
    }
}
