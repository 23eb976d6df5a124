//! Where a process's CPU time went over a load, by thread name (Linux `/proc`): CPU seconds
//! and involuntary context switches (a thread that wanted the core but lost it), with the
//! machine's busy share over the same interval. For a serving process it tells whether a
//! thread that issues GPU work waited for a core.

use std::collections::BTreeMap;
use std::time::Instant;

use serde_json::{Value, json};

/// Per thread name: (CPU ticks, involuntary switches, voluntary switches, threads).
type ByName = BTreeMap<String, (u64, u64, u64, u64)>;

/// One reading of a process's threads and of the machine's CPU counters.
pub struct Sample {
    at: Instant,
    threads: ByName,
    /// (busy, total) jiffies over every core (`/proc/stat`).
    machine: (u64, u64),
}

fn field(status: &str, key: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

fn machine() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(cpu) = stat.lines().next() else {
        return (0, 0);
    };
    let v: Vec<u64> = cpu
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().sum();
    // idle and iowait are the 4th and 5th numbers.
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

impl Sample {
    /// Reads every thread of process `pid`.
    pub fn take(pid: u32) -> Self {
        Self::take_all(&[pid])
    }

    /// Reads every thread of several processes (a role's replicas), summed by thread name.
    pub fn take_all(pids: &[u32]) -> Self {
        let mut threads = ByName::new();
        let tasks = pids.iter().flat_map(|pid| {
            std::fs::read_dir(format!("/proc/{pid}/task"))
                .into_iter()
                .flatten()
                .flatten()
        });
        for e in tasks {
            let p = e.path();
            let (Ok(stat), Ok(status)) = (
                std::fs::read_to_string(p.join("stat")),
                std::fs::read_to_string(p.join("status")),
            ) else {
                continue;
            };
            let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
                continue;
            };
            let name = stat[open + 1..close].to_owned();
            let f: Vec<&str> = stat[close + 2..].split(' ').collect();
            let tick = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            let t = threads.entry(name).or_default();
            t.0 += tick(11) + tick(12);
            t.1 += field(&status, "nonvoluntary_ctxt_switches:");
            t.2 += field(&status, "voluntary_ctxt_switches:");
            t.3 += 1;
        }
        Sample {
            at: Instant::now(),
            threads,
            machine: machine(),
        }
    }

    /// What happened between `self` and a later sample: per thread name, CPU seconds,
    /// involuntary and voluntary context switches; the machine's busy share of its cores.
    pub fn until(&self, later: &Sample) -> Value {
        let wall = later.at.duration_since(self.at).as_secs_f64();
        let mut by = serde_json::Map::new();
        for (name, b) in &later.threads {
            let a = self.threads.get(name).copied().unwrap_or_default();
            let cpu = b.0.saturating_sub(a.0) as f64 / 100.0;
            if cpu == 0.0 && b.1 == a.1 {
                continue;
            }
            by.insert(
                name.clone(),
                json!({
                    "threads": b.3,
                    "cpu_s": cpu,
                    "involuntary_switches": b.1.saturating_sub(a.1),
                    "voluntary_switches": b.2.saturating_sub(a.2),
                }),
            );
        }
        let (busy, total) = (
            later.machine.0.saturating_sub(self.machine.0),
            later.machine.1.saturating_sub(self.machine.1),
        );
        json!({
            "wall_s": wall,
            "machine_busy_share": busy as f64 / total.max(1) as f64,
            "by_thread_name": by,
        })
    }
}
