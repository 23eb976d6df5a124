use super::*;
use crate::index::hnsw::Scan;
use crate::testutil::*;

/// The crash window of the write path: the batch is in RocksDB (and the op log) but the
/// process died before tantivy committed. Reopening must make it searchable by both indexes.
#[test]
fn batch_committed_only_to_rocksdb_is_replayed_on_open() {
    let dir = tempfile::tempdir().unwrap();
    let key = ShardKey::new("c", 0);
    let store = Arc::new(Store::open(&dir.path().join("db"), true).unwrap());
    {
        let shard = open(dir.path(), key.clone(), store.clone(), 1000);
        apply(&shard, batch(vec![doc("a", "alpha apples", 1.0)])).unwrap();
    }
    // Simulated crash after step 1 of the write path: RocksDB only.
    let mut b = batch(vec![doc("b", "bravo bananas", 2.0)]);
    hnsw::normalize(&mut b.writes[0].chunks[0].embedding);
    store.commit_batch(&key, 2, &b, None).unwrap();
    let shard = open(dir.path(), key, store, 1000);
    assert_eq!(shard.applied_seq(), 2);
    assert_eq!(shard.visible_seq(), 2);
    let hits = shard
        .bm25_search(
            "bananas",
            5,
            &crate::index::Filter::default(),
            None,
            HitForm::Chunk,
        )
        .unwrap();
    assert_eq!(hits.len(), 1);
    assert_eq!(hits[0].chunk.as_ref().unwrap().doc_id, "b");
    let v: Vec<f32> = (0..DIM).map(|i| (2.0 + i as f32).sin()).collect();
    let hits = shard
        .vector_search(
            &v,
            1,
            Scan::Walk(16),
            &crate::index::Filter::default(),
            HitForm::Chunk,
        )
        .unwrap();
    assert_eq!(hits[0].chunk.as_ref().unwrap().doc_id, "b");
    assert!(
        hits[0].chunk.as_ref().unwrap().embedding.is_empty(),
        "search hits carry no vectors"
    );
}

/// The three forms of a hit carry the same chunk: the encoded one is the stored value, which
/// decodes to what the decoded form returns; ids only carry the id. Scores are the same.
#[test]
fn encoded_hits_decode_to_the_chunk_hits() {
    use prost::Message;
    let dir = tempfile::tempdir().unwrap();
    let key = ShardKey::new("c", 0);
    let store = Arc::new(Store::open(&dir.path().join("db"), true).unwrap());
    let shard = open(dir.path(), key, store, 1000);
    apply(
        &shard,
        batch(vec![
            doc("a", "alpha apples", 1.0),
            doc("b", "bravo apples and bananas", 2.0),
        ]),
    )
    .unwrap();
    let v: Vec<f32> = (0..DIM).map(|i| (2.0 + i as f32).sin()).collect();
    let searches: [&dyn Fn(HitForm) -> Vec<ShardHit>; 2] = [
        &|f| {
            shard
                .bm25_search("apples", 5, &crate::index::Filter::default(), None, f)
                .unwrap()
        },
        &|f| {
            shard
                .vector_search(&v, 2, Scan::Walk(16), &crate::index::Filter::default(), f)
                .unwrap()
        },
    ];
    for search in searches {
        let (plain, encoded, ids) = (
            search(HitForm::Chunk),
            search(HitForm::Encoded),
            search(HitForm::Id),
        );
        assert_eq!(plain.len(), 2);
        assert_eq!(encoded.len(), 2);
        for ((p, e), i) in plain.iter().zip(&encoded).zip(&ids) {
            let c = p.chunk.as_ref().unwrap();
            assert!(e.chunk.is_none());
            assert_eq!(e.chunk_id, c.chunk_id);
            assert_eq!(&Chunk::decode(e.chunk_encoded.clone()).unwrap(), c);
            assert_eq!(i.chunk.as_ref().unwrap().chunk_id, c.chunk_id);
            assert!(i.chunk.as_ref().unwrap().text.is_empty());
            assert_eq!((p.score, e.score, i.score), (p.score, p.score, p.score));
        }
    }
}

/// A follower holds its points pending (searched exactly), then loads the leader's dump
/// and keeps pending only what changed after it; it answers like the leader throughout.
#[test]
fn follower_adopts_the_leaders_graph() {
    let (ld, fd) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let key = ShardKey::new("c", 0);
    let mut o = opts(1000);
    o.dumping.min_changes = 5;
    let leader = open_with(
        ld.path(),
        key.clone(),
        Arc::new(Store::open(&ld.path().join("db"), false).unwrap()),
        &o,
    );
    let follower = open_with(
        fd.path(),
        key,
        Arc::new(Store::open(&fd.path().join("db"), false).unwrap()),
        &o,
    );
    follower.set_following(true);
    let first = batch(
        (0..20)
            .map(|i| doc(&format!("d{i}"), "words", i as f32))
            .collect(),
    );
    let delete = deleted("d4");
    let second = batch(vec![doc("d3", "words", 30.0), delete]);
    for b in [first, second] {
        apply(&leader, b.clone()).unwrap();
        apply(&follower, b).unwrap();
    }
    assert_eq!(follower.pending_points(), 19, "every live point pending");
    let same = |f: &Shard| {
        for seed in (0..20).map(|i| i as f32).chain([30.0]) {
            assert_eq!(top(f, seed), top(&leader, seed), "seed {seed}");
        }
        assert_ne!(top(f, 4.0), "d4#0", "deleted");
    };
    same(&follower);
    // The leader dumped after the first batch (5 changes or more), not after the second.
    let section = leader
        .graph_dump_after(0, follower.visible_seq())
        .unwrap()
        .expect("a dump newer than none");
    assert_eq!(follower.receive_graph(&section).unwrap(), 1);
    let until = Instant::now() + std::time::Duration::from_secs(10);
    while follower.graph_dump_seq() != 1 && Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(follower.graph_dump_seq(), 1, "dump adopted");
    assert_eq!(
        follower.pending_points(),
        1,
        "only d3's new chunk is pending"
    );
    assert_eq!(follower.figures().hnsw_points, 19);
    same(&follower);
    assert!(leader.graph_dump_after(1, 2).unwrap().is_none());
    // Restarted, it loads the adopted dump and catches up from its op log.
    let store = follower.store().clone();
    follower.flush().unwrap();
    drop(follower);
    let reopened = open_with(fd.path(), ShardKey::new("c", 0), store, &o);
    settle(&reopened);
    same(&reopened);
}

#[test]
fn replacements_leave_tombstones_until_compaction() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&dir.path().join("db"), false).unwrap());
    let shard = open(dir.path(), ShardKey::new("c", 1), store, 3);
    apply(
        &shard,
        batch(
            (0..8)
                .map(|i| doc(&format!("d{i}"), "words", i as f32))
                .collect(),
        ),
    )
    .unwrap();
    // Replacing d0 twice leaves two tombstones: under the compaction minimum of 3.
    apply(&shard, batch(vec![doc("d0", "words", 10.0)])).unwrap();
    apply(&shard, batch(vec![doc("d0", "words", 11.0)])).unwrap();
    let f = shard.figures();
    assert_eq!((f.hnsw_points, f.hnsw_tombstones), (8, 2));
    // A third replacement crosses the minimum (3 of 11 >= 25 %): the graph is rebuilt.
    apply(&shard, batch(vec![doc("d1", "words", 12.0)])).unwrap();
    let f = shard.figures();
    assert_eq!((f.hnsw_points, f.hnsw_tombstones), (8, 0));
    assert_eq!(f.documents, 8);
    assert_eq!(f.chunks, 8);
    // Deleting and bad batches.
    let mut del = batch(vec![deleted("d2")]);
    let applied = apply(&shard, del.clone()).unwrap();
    assert_eq!(applied.existed, 1);
    assert_eq!(shard.figures().documents, 7);
    del.writes[0].doc_id = "nope".into();
    assert_eq!(
        apply(&shard, del).unwrap().not_found,
        vec!["nope".to_string()]
    );
    let mut wrong = doc("x", "w", 1.0);
    wrong.chunks[0].embedding.pop();
    assert!(matches!(
        apply(&shard, batch(vec![wrong])),
        Err(ShardError::InvalidArgument(_))
    ));
    let seq = shard.applied_seq();
    assert!(matches!(
        apply(&shard, batch(vec![doc("y", "w", 1.0), doc("y", "w", 2.0)])),
        Err(ShardError::InvalidArgument(_))
    ));
    assert_eq!(
        shard.applied_seq(),
        seq + 1,
        "a rejected entry only moves the applied index"
    );
    assert_eq!(shard.figures().documents, 7);
}

/// A clean shutdown dumps the graph; entries written after the dump (here straight into
/// RocksDB, as a crash before indexing leaves them) are caught up at open from the op log:
/// replaced and deleted documents lose their old points, new ones are found.
#[test]
fn hnsw_dump_is_loaded_and_caught_up_from_the_op_log() {
    let dir = tempfile::tempdir().unwrap();
    let key = ShardKey::new("c", 3);
    let store = Arc::new(Store::open(&dir.path().join("db"), false).unwrap());
    {
        let shard = open(dir.path(), key.clone(), store.clone(), 1000);
        let docs = (0..50)
            .map(|i| doc(&format!("d{i}"), "w", i as f32))
            .collect();
        apply(&shard, batch(docs)).unwrap();
        shard.flush().unwrap();
    }
    let dumps: Vec<_> = std::fs::read_dir(dir.path().join("hnsw"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(dumps, vec!["dump-1".to_string()]);
    // After the dump: d0 gets a new vector, d1 is deleted, n0 is new.
    let mut b = batch(vec![
        doc("d0", "w", 100.0),
        deleted("d1"),
        doc("n0", "w", 200.0),
    ]);
    for w in &mut b.writes {
        for c in &mut w.chunks {
            hnsw::normalize(&mut c.embedding);
        }
    }
    store.commit_batch(&key, 2, &b, None).unwrap();
    let shard = open(dir.path(), key.clone(), store.clone(), 1000);
    let f = shard.figures();
    // Loaded, not rebuilt: the caught-up documents left tombstones (a rebuild leaves none).
    assert_eq!((f.hnsw_points, f.hnsw_tombstones), (50, 2));
    assert_eq!(top(&shard, 100.0), "d0#0");
    assert_eq!(top(&shard, 200.0), "n0#0");
    assert_ne!(top(&shard, 1.0), "d1#0");
    assert_eq!(top(&shard, 7.0), "d7#0");
    drop(shard);
    // Two entries after the dump touch the same documents: each one's last write counts
    // (n0 rewritten, d0 replaced then deleted, n1 new).
    let b = normalized(batch(vec![
        doc("n0", "w", 300.0),
        deleted("d0"),
        doc("n1", "w", 400.0),
    ]));
    store.commit_batch(&key, 3, &b, None).unwrap();
    let shard = open(dir.path(), key.clone(), store.clone(), 1000);
    let f = shard.figures();
    assert_eq!((f.hnsw_points, f.hnsw_tombstones), (50, 2));
    assert_eq!(top(&shard, 300.0), "n0#0");
    assert_eq!(top(&shard, 400.0), "n1#0");
    assert_ne!(top(&shard, 100.0), "d0#0");
    let v = normalized_vec(300.0);
    let ids: Vec<String> = shard
        .vector_search(
            &v,
            60,
            Scan::Walk(64),
            &crate::index::Filter::default(),
            HitForm::Chunk,
        )
        .unwrap()
        .into_iter()
        .map(|h| h.chunk.unwrap().chunk_id)
        .collect();
    assert_eq!(ids.len(), 50, "every live chunk once");
    assert_eq!(ids.iter().filter(|i| *i == "n0#0").count(), 1);
    shard.flush().unwrap();
    drop(shard);
    // The dump holds no second copy of the live vectors (RocksDB has them).
    assert!(!dir.path().join("hnsw/dump-3/graph.hnsw.data").exists());
    // A damaged dump is refused and the graph rebuilt: same answers, no tombstones.
    let data = dir.path().join("hnsw/dump-3/graph.hnsw.graph");
    let mut bytes = std::fs::read(&data).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&data, bytes).unwrap();
    let shard = open(dir.path(), key, store, 1000);
    let f = shard.figures();
    assert_eq!((f.hnsw_points, f.hnsw_tombstones), (50, 0));
    assert_eq!(top(&shard, 300.0), "n0#0");
    assert_eq!(top(&shard, 7.0), "d7#0");
}

/// Retried request ids are applied once, and their first outcome is returned.
#[test]
fn request_ids_apply_at_most_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&dir.path().join("db"), false).unwrap());
    let shard = open(dir.path(), ShardKey::new("c", 2), store, 1000);
    let mut first = batch(vec![doc("a", "one", 1.0)]);
    first.request_id = "req-1".into();
    let r1 = apply(&shard, first.clone()).unwrap();
    assert!(!r1.duplicate);
    // A newer write of the same document, then a late retry of the first request.
    apply(&shard, batch(vec![doc("a", "two", 2.0)])).unwrap();
    let r2 = apply(&shard, first).unwrap();
    assert!(r2.duplicate);
    assert_eq!(r2.applied_seq, r1.applied_seq);
    let hits = shard
        .bm25_search(
            "two",
            5,
            &crate::index::Filter::default(),
            None,
            HitForm::Chunk,
        )
        .unwrap();
    assert_eq!(hits.len(), 1, "the retry did not overwrite the newer write");
}

/// Commits wait for the interval while writes come concurrently (`worker::commit_due`): a
/// write is acknowledged (visible) only once committed, and whatever is staged meanwhile
/// stays in the op log, so a crash replays it; a clean stop commits it.
#[test]
fn staged_writes_stay_in_the_op_log_until_committed() {
    let dir = tempfile::tempdir().unwrap();
    let key = ShardKey::new("c", 0);
    let store = Arc::new(Store::open(&dir.path().join("db"), false).unwrap());
    let mut o = opts(1000);
    o.committing = crate::index::worker::Committing {
        interval: std::time::Duration::from_secs(3600),
        max_chunks: usize::MAX,
    };
    let shard = open_with(dir.path(), key.clone(), store.clone(), &o);
    // Entries applied back to back, as the Raft thread does under concurrent writes.
    for seq in 1..=6u64 {
        let id = format!("d{seq}");
        shard
            .apply_entry(
                seq,
                batch(vec![doc(&id, "bravo bananas", seq as f32)]),
                1_000,
            )
            .unwrap()
            .unwrap();
    }
    let until = Instant::now() + std::time::Duration::from_secs(10);
    while top(&shard, 6.0) != "d6#0" && Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(top(&shard, 6.0), "d6#0", "HNSW inserts are not held back");
    // The worker may still be committing the last group at once (a lone batch): wait until
    // it rests (the next commit is an hour away).
    let mut committed = shard.indexes.bm25.committed_seq().unwrap();
    loop {
        std::thread::sleep(std::time::Duration::from_millis(100));
        let now = shard.indexes.bm25.committed_seq().unwrap();
        if now == committed {
            break;
        }
        committed = now;
    }
    assert!(committed <= shard.visible_seq() && shard.visible_seq() <= 6);
    let kept: Vec<u64> = store
        .oplog_after(&key, 0)
        .unwrap()
        .into_iter()
        .map(|(seq, _)| seq)
        .collect();
    assert_eq!(
        kept,
        (committed + 1..=6).collect::<Vec<_>>(),
        "every entry after the committed seq stays in the op log"
    );
    // A clean stop commits what was staged.
    drop(shard);
    let reopened = open_with(dir.path(), key, store, &o);
    settle(&reopened);
    assert_eq!(reopened.indexes.bm25.committed_seq().unwrap(), 6);
    let hits = reopened
        .bm25_search(
            "bananas",
            10,
            &crate::index::Filter::default(),
            None,
            HitForm::Chunk,
        )
        .unwrap();
    assert_eq!(hits.len(), 6);
}

fn normalized(mut b: WriteBatchRequest) -> WriteBatchRequest {
    for w in &mut b.writes {
        for c in &mut w.chunks {
            hnsw::normalize(&mut c.embedding);
        }
    }
    b
}

/// A dump written while points are held beside the graph stands for the graph through the
/// entry before the oldest held point; opening catches it up from the op log after that
/// entry, so the held points (and a later replacement of a graph point) come back.
#[test]
fn dump_taken_while_points_are_held_is_caught_up_at_open() {
    use crate::index::{hnsw::dump::Dumps, point, recovery};
    let dir = tempfile::tempdir().unwrap();
    let key = ShardKey::new("c", 5);
    let store = Store::open(&dir.path().join("db"), false).unwrap();
    let m = meta();
    let entries = [
        normalized(batch(
            (0..10)
                .map(|i| doc(&format!("d{i}"), "w", i as f32))
                .collect(),
        )),
        normalized(batch(
            (10..20)
                .map(|i| doc(&format!("d{i}"), "w", i as f32))
                .collect(),
        )),
        // Replaces d3, which the graph holds, by a new vector.
        normalized(batch(vec![doc("d3", "w", 300.0), doc("n0", "w", 400.0)])),
    ];
    let idx = hnsw::HnswIndex::new(DIM, m.hnsw, 100);
    for (i, b) in entries.iter().enumerate() {
        let seq = i as u64 + 1;
        store.commit_batch(&key, seq, b, None).unwrap();
        let points = b
            .writes
            .iter()
            .flat_map(|w| w.chunks.iter().map(point))
            .collect();
        if seq == 1 {
            idx.insert(points);
        } else {
            idx.defer(points, seq);
        }
    }
    assert_eq!(idx.pending_len(), 12);
    assert_eq!(idx.graph_through(3), 1);
    // Inserting the oldest held entry moves the graph on by whole entries.
    assert_eq!(idx.absorb_some(1), 10);
    assert_eq!(idx.graph_through(3), 2);
    let dumps = Dumps::new(dir.path().join("hnsw"));
    dumps.write(&idx, idx.graph_through(3)).unwrap();
    let (back, state) = recovery::open_hnsw(&key, &m, &store, &dumps, 3).unwrap();
    assert_eq!(state.dumped, Some(2), "loaded, not rebuilt");
    assert_eq!(back.counts().0, 21);
    assert_eq!(back.pending_len(), 2, "entry 3's chunks are held again");
    let hit = |i: &hnsw::HnswIndex, seed: f32| {
        i.search(
            &normalized_vec(seed),
            1,
            16,
            &crate::index::Filter::default(),
        )[0]
        .0
        .clone()
    };
    for seed in [0.0, 7.0, 15.0, 300.0, 400.0] {
        assert_eq!(hit(&back, seed), hit(&idx, seed), "seed {seed}");
    }
    assert_eq!(hit(&back, 300.0), "d3#0");
    assert_ne!(hit(&back, 3.0), "d3#0", "d3's old vector is gone");
}

fn normalized_vec(seed: f32) -> Vec<f32> {
    let mut v = vec_of(seed);
    hnsw::normalize(&mut v);
    v
}

/// A write-behind leader acknowledges writes whose points are not in the graph yet: each is
/// searchable the moment it is acknowledged, the graph takes them in when writes pause, and
/// a restart (clean, or with the graph behind) answers the same.
#[test]
fn written_behind_points_are_searchable_then_inserted() {
    let dir = tempfile::tempdir().unwrap();
    let key = ShardKey::new("c", 6);
    let store = Arc::new(Store::open(&dir.path().join("db"), false).unwrap());
    let mut o = opts(1000);
    o.following.behind_max = 15;
    o.dumping.min_changes = 5;
    let shard = open_with(dir.path(), key.clone(), store.clone(), &o);
    for b in 0..6 {
        let docs = (b * 10..b * 10 + 10)
            .map(|i| doc(&format!("d{i}"), "w", i as f32))
            .collect();
        apply(&shard, batch(docs)).unwrap();
        for i in b * 10..b * 10 + 10 {
            assert_eq!(
                top(&shard, i as f32),
                format!("d{i}#0"),
                "acknowledged d{i}"
            );
        }
        assert!(shard.pending_points() <= 15);
    }
    let until = Instant::now() + std::time::Duration::from_secs(10);
    while shard.pending_points() > 0 && Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(shard.pending_points(), 0, "inserted once writes paused");
    assert_eq!(shard.figures().hnsw_points, 60);
    // The dump that follows lets go of the op-log entries the held points kept, without a
    // further write (no BM25 commit comes after them).
    while !store.oplog_after(&key, 0).unwrap().is_empty() && Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(
        store.oplog_after(&key, 0).unwrap().len(),
        0,
        "op log trimmed"
    );
    // A burst left unsettled, then a restart without a clean stop.
    for i in 60..90 {
        let seq = shard.applied_seq() + 1;
        shard
            .apply_entry(
                seq,
                batch(vec![doc(&format!("d{i}"), "w", i as f32)]),
                1_000,
            )
            .unwrap()
            .unwrap();
    }
    settle(&shard);
    drop(shard);
    let shard = open_with(dir.path(), key.clone(), store.clone(), &o);
    settle(&shard);
    for i in 0..90 {
        assert_eq!(
            top(&shard, i as f32),
            format!("d{i}#0"),
            "after restart d{i}"
        );
    }
    shard.flush().unwrap();
    drop(shard);
    let shard = open_with(dir.path(), key, store, &o);
    assert_eq!(shard.figures().hnsw_points, 90);
    for i in (0..90).step_by(7) {
        assert_eq!(
            top(&shard, i as f32),
            format!("d{i}#0"),
            "after a clean stop d{i}"
        );
    }
}

/// Bytes of the write-ahead-log files in a RocksDB directory.
fn wal_bytes(db: &std::path::Path) -> u64 {
    std::fs::read_dir(db)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

/// A burst of writes sits in RocksDB's write-ahead log (each chunk several times over) until
/// the memtables behind it are flushed. Once a write-behind burst is in the graph, the graph is
/// dumped, the burst's op log dropped and the memtables flushed, so that log leaves the disk
/// without waiting for more writes, the dump interval or a restart.
#[test]
fn write_ahead_log_is_released_at_rest() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("db");
    let key = ShardKey::new("c", 7);
    let store = Arc::new(Store::open(&db, false).unwrap());
    let mut o = opts(1000);
    // Written behind, and fewer points than a dump waits for (`dumping.min_changes`): the
    // dump that lets the op log go comes once the graph holds the burst.
    o.following.behind_max = 1000;
    let shard = open_with(dir.path(), key.clone(), store.clone(), &o);
    let text: String = (0..3000).map(|j| format!("w{j} ")).collect();
    for b in 0..20 {
        let docs = (b * 10..b * 10 + 10)
            .map(|i| doc(&format!("d{i}"), &text, i as f32))
            .collect();
        apply(&shard, batch(docs)).unwrap();
    }
    let written = wal_bytes(&db);
    assert!(
        written > 6 << 20,
        "the burst is in the log: {written} bytes"
    );
    let until = Instant::now() + std::time::Duration::from_secs(20);
    while (wal_bytes(&db) > 1 << 20 || !store.oplog_after(&key, 0).unwrap().is_empty())
        && Instant::now() < until
    {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        store.oplog_after(&key, 0).unwrap().is_empty(),
        "op log dropped"
    );
    let left = wal_bytes(&db);
    assert!(
        left <= 1 << 20,
        "log released: {left} of {written} bytes left"
    );
    shard.flush().unwrap();
    drop(shard);
    let shard = open_with(dir.path(), key, store, &o);
    assert_eq!(shard.figures().hnsw_points, 200);
    for i in (0..200).step_by(13) {
        assert_eq!(
            top(&shard, i as f32),
            format!("d{i}#0"),
            "after reopening d{i}"
        );
    }
}

/// A re-embedding's versioned writes (`storage::versions`): a write older than what the
/// shard holds is skipped, even after a delete (its version stays), and a plain write makes
/// the document the shard's own again.
#[test]
fn versioned_writes_keep_the_newest_content() {
    let dir = tempfile::tempdir().unwrap();
    let key = ShardKey::new("c", 0);
    let store = Arc::new(Store::open(&dir.path().join("db"), true).unwrap());
    let shard = open(dir.path(), key.clone(), store.clone(), 1000);
    let versioned = |w: ragcluster_proto::v1::DocumentWrite, version: u64| WriteBatchRequest {
        version,
        ..batch(vec![w])
    };
    let text = |id: &str| {
        shard
            .doc_chunks(&[id.to_owned()], false)
            .unwrap()
            .first()
            .map(|c| c.text.clone())
    };
    let r = apply(&shard, versioned(doc("a", "mirrored write", 1.0), 10)).unwrap();
    assert!(r.stale.is_empty());
    let r = apply(&shard, versioned(doc("a", "older copy", 1.0), 7)).unwrap();
    assert_eq!(r.stale, vec!["a".to_owned()]);
    assert_eq!(text("a").as_deref(), Some("mirrored write"));
    // The same version again (a retried mirror) is skipped too.
    let r = apply(&shard, versioned(doc("a", "again", 1.0), 10)).unwrap();
    assert_eq!(r.stale.len(), 1);
    // A delete keeps its version: an older copy cannot bring the document back.
    apply(&shard, versioned(deleted("a"), 12)).unwrap();
    let r = apply(&shard, versioned(doc("a", "stale copy", 1.0), 11)).unwrap();
    assert_eq!(r.stale.len(), 1);
    assert_eq!(text("a"), None);
    assert_eq!(store.doc_version(&key, "a").unwrap(), Some(12));
    let r = apply(&shard, versioned(doc("a", "newer", 1.0), 13)).unwrap();
    assert!(r.stale.is_empty());
    assert_eq!(text("a").as_deref(), Some("newer"));
    // A plain write forgets the version.
    apply(&shard, batch(vec![doc("a", "own write", 1.0)])).unwrap();
    assert_eq!(store.doc_version(&key, "a").unwrap(), None);
    let r = apply(&shard, versioned(doc("a", "copy after", 1.0), 2)).unwrap();
    assert!(r.stale.is_empty());
    // A write in a later epoch is versioned by its own entry and wins over late writes of an
    // earlier epoch whatever their index; one of an earlier epoch is itself skipped.
    use ragcluster_common::versions::version;
    let r = apply(&shard, versioned(doc("a", "epoch 1", 1.0), version(1, 900))).unwrap();
    assert!(r.stale.is_empty());
    let own = WriteBatchRequest {
        version_epoch: 2,
        ..batch(vec![doc("a", "epoch 2", 1.0)])
    };
    let r = apply(&shard, own).unwrap();
    assert!(r.stale.is_empty());
    let at = store.doc_version(&key, "a").unwrap().unwrap();
    assert_eq!(at, version(2, r.applied_seq));
    let r = apply(&shard, versioned(doc("a", "late", 1.0), version(1, 5000))).unwrap();
    assert_eq!(r.stale.len(), 1);
    let late = WriteBatchRequest {
        version_epoch: 1,
        ..batch(vec![doc("a", "late own", 1.0)])
    };
    assert_eq!(apply(&shard, late).unwrap().stale.len(), 1);
    assert_eq!(text("a").as_deref(), Some("epoch 2"));
    // A versioned batch carries writes only, and one version.
    let both = WriteBatchRequest {
        version: 3,
        version_epoch: 1,
        ..batch(vec![doc("a", "x", 1.0)])
    };
    assert!(apply(&shard, both).is_err());
    let bad = WriteBatchRequest {
        version: 3,
        changes: vec![ragcluster_proto::v1::DocumentChange {
            doc_ids: vec!["a".into()],
            delete: true,
            ..Default::default()
        }],
        ..Default::default()
    };
    assert!(apply(&shard, bad).is_err());
}
