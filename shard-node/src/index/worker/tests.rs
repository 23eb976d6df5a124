use super::apply::{Staged, commit_due};
use super::*;

#[test]
fn concurrent_writes_share_commits_a_lone_writer_never_waits() {
    let c = Committing {
        interval: Duration::from_millis(50),
        max_chunks: 100,
    };
    let now = Instant::now();
    let last = now - Duration::from_millis(10);
    let s = |batches, chunks, last_commit_batches| Staged {
        seq: Some(1),
        batches,
        chunks,
        last_commit: Some(last),
        last_commit_batches,
    };
    // One batch after a commit of one: a writer waiting for each acknowledgement.
    assert_eq!(commit_due(&c, s(1, 10, 1), now), now);
    // Several batches staged, or the last commit held several: wait for the interval.
    assert_eq!(commit_due(&c, s(3, 30, 1), now), last + c.interval);
    assert_eq!(commit_due(&c, s(1, 10, 4), now), last + c.interval);
    // Enough chunks commit at once.
    assert_eq!(commit_due(&c, s(3, 100, 4), now), now);
    // The first commit ever, and after a quiet spell (due in the past: at once).
    let first = Staged {
        last_commit: None,
        ..s(3, 30, 0)
    };
    assert_eq!(commit_due(&c, first, now), now);
    let quiet = Staged {
        last_commit: Some(now - Duration::from_secs(1)),
        ..s(3, 30, 4)
    };
    assert!(commit_due(&c, quiet, now) <= now);
    // Interval zero: every group at once.
    let zero = Committing {
        interval: Duration::ZERO,
        ..c
    };
    assert_eq!(commit_due(&zero, s(3, 30, 4), now), last);
}
