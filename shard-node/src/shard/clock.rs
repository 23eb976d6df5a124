//! The time stamped on each log entry (`RaftCommand.proposed_at_ms`). Every replica forgets
//! request ids older than `DEDUPE_WINDOW_MS` by the stamp of the entry it applies, so a stamp
//! must not follow a wall clock that steps: a leader whose clock jumped a day ahead would
//! stamp an entry that makes every replica forget every request id of the last hour, and a
//! write retried with its request id would be applied twice. So stamps run on the monotonic
//! clock from the newest stamp this replica applied (that stamp plus the time since it was
//! applied here), and never go back. Only the first entry after a start reads the wall clock.

use std::time::Instant;

#[derive(Default)]
pub struct LogClock {
    /// The newest stamp applied here and when it was.
    last: parking_lot::Mutex<Option<(u64, Instant)>>,
}

impl LogClock {
    /// The stamp for an entry proposed now.
    pub fn stamp(&self) -> u64 {
        match *self.last.lock() {
            Some((ts, at)) => ts + at.elapsed().as_millis() as u64,
            None => ragcluster_raft::now_ms(),
        }
    }

    /// An entry stamped `ts` was applied: stamps go on from it unless this replica's own
    /// count is already past it.
    pub fn applied(&self, ts: u64) {
        let mut last = self.last.lock();
        let ahead = last.is_some_and(|(t, at)| t + at.elapsed().as_millis() as u64 >= ts);
        if !ahead {
            *last = Some((ts, Instant::now()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_follow_the_log_not_a_wall_clock_that_steps() {
        let c = LogClock::default();
        // Another leader's wall clock was a day ahead: stamps go on from there...
        let day_ahead = ragcluster_raft::now_ms() + 86_400_000;
        c.applied(day_ahead);
        assert!(c.stamp() >= day_ahead);
        // ...and an entry stamped by a clock stepped back does not move them back.
        c.applied(day_ahead - 7_200_000);
        assert!(c.stamp() >= day_ahead);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(c.stamp() >= day_ahead + 20);
    }
}
