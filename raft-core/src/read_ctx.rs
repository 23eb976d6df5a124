//! The context of a read-index request: a random nonce of the member instance, then the
//! request's seq. Seqs start over when the process restarts, and raft-rs matches answers by
//! context alone (a leader's answer to the previous process, delivered late, must not release
//! a read of this one) and drops a request whose context another follower's pending request
//! already has; the nonce keeps contexts apart across restarts and nodes.

/// The context of request `seq` of the instance with `nonce`.
pub(crate) fn encode(nonce: u64, seq: u64) -> Vec<u8> {
    let mut ctx = Vec::with_capacity(16);
    ctx.extend_from_slice(&nonce.to_be_bytes());
    ctx.extend_from_slice(&seq.to_be_bytes());
    ctx
}

/// The seq of `ctx` if it is a request of the instance with `nonce`.
pub(crate) fn decode(nonce: u64, ctx: &[u8]) -> Option<u64> {
    let (n, seq) = ctx.split_at_checked(8)?;
    if n != nonce.to_be_bytes() {
        return None;
    }
    Some(u64::from_be_bytes(seq.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_this_instances_contexts_decode() {
        assert_eq!(decode(7, &encode(7, 42)), Some(42));
        assert_eq!(decode(8, &encode(7, 42)), None);
        // The 8-byte contexts of before, and anything else, are not ours.
        assert_eq!(decode(7, &42u64.to_be_bytes()), None);
        assert_eq!(decode(7, &[]), None);
    }
}
