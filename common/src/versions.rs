//! Document versions of a re-embedding (`WriteBatchRequest.version`): the job's epoch above
//! a log index, so that every write of a later epoch (after a switch or a rollback, when the
//! other collection serves and log indexes come from its shards) orders after every write of
//! an earlier one. The coordinator composes them for copies and mirrors, a shard for a write
//! that names only the epoch (`version_epoch`, versioned by its own log index).

/// Bits of a version that hold the log index.
pub const SEQ_BITS: u32 = 48;
/// The largest epoch a version can hold.
pub const MAX_EPOCH: u32 = u16::MAX as u32;

/// The version of content taken at log index `seq` in `epoch`.
pub fn version(epoch: u32, seq: u64) -> u64 {
    (u64::from(epoch.min(MAX_EPOCH)) << SEQ_BITS) | (seq & ((1 << SEQ_BITS) - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_later_epoch_orders_after_any_index_of_an_earlier_one() {
        assert!(version(2, 1) > version(1, (1 << SEQ_BITS) - 1));
        assert!(version(1, 7) < version(1, 8));
        assert_eq!(version(0, 5), 5);
    }
}
