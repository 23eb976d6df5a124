#!/usr/bin/env python3
"""The Qdrant engine in process (qdrant-edge-py, one EdgeShard) reading back the corpus that
`browsebench --engines PYTHON` exports: the reference rows of issue 69's Scroll and Count
targets, on the same machine in the same run.

Each chunk is a point with its vector and a payload as ragcluster stores the chunk (chunk_id,
doc_id, position, title, text and the keyword fields p2, p10, p100, p1000), with a keyword
payload index on each keyword field. Then:

- scroll every point in pages of 1,000 with the payload (as ragcluster's Scroll returns the
  chunk), chunks/s; and the points of the 10% filter p10 = "3";
- count, exactly, with no filter and with each field = "1", `--counts` calls each: p50 / p99.

Prints one JSON object with the same keys as browsebench's own row.
Setup: `bash scripts/setup-bench-python.sh --engines`.
"""

import argparse
import json
import os
import shutil
import time

import qdrant_edge as qe

FIELDS = [("p2", "50%"), ("p10", "10%"), ("p100", "1%"), ("p1000", "0.1%")]


def percentile(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def keyword_filter(pairs):
    if not pairs:
        return None
    return qe.Filter(
        must=[qe.FieldCondition(key=k, match=qe.MatchValue(value=v)) for k, v in pairs]
    )


def scroll_all(shard, pairs):
    t = time.perf_counter()
    n, offset = 0, None
    while True:
        req = qe.ScrollRequest(
            offset=offset, limit=1000, filter=keyword_filter(pairs), with_payload=True
        )
        points, offset = shard.scroll(req)
        n += len(points)
        if offset is None:
            return n, time.perf_counter() - t


def counts(shard, pairs, calls):
    req = qe.CountRequest(exact=True, filter=keyword_filter(pairs))
    lat, last = [], 0
    for _ in range(calls):
        t = time.perf_counter()
        last = shard.count(req)
        lat.append((time.perf_counter() - t) * 1e3)
    return {"chunks": last, "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("corpus")
    ap.add_argument("--counts", type=int, default=200)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    corpus = load(args.corpus)
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    dim = len(corpus[0]["vector"])
    config = qe.EdgeConfig(
        vectors={"dense": qe.EdgeVectorParams(size=dim, distance=qe.Distance.Cosine)}
    )
    shard = qe.EdgeShard.create(args.work, config)
    for k, _ in FIELDS:
        shard.update(qe.UpdateOperation.create_field_index(k, qe.PayloadSchemaType.Keyword))
    t = time.perf_counter()
    for s in range(0, len(corpus), 512):
        points = []
        for j, c in enumerate(corpus[s : s + 512]):
            payload = {k: c[k] for k in ("chunk_id", "doc_id", "position", "title", "text")}
            payload.update(c["metadata"])
            points.append(qe.Point(id=s + j, vector={"dense": c["vector"]}, payload=payload))
        shard.update(qe.UpdateOperation.upsert_points(points))
    shard.flush()
    shard.optimize()
    ingest_s = time.perf_counter() - t
    n, secs = scroll_all(shard, [])
    fn, fsecs = scroll_all(shard, [("p10", "3")])
    out = {
        "chunks": len(corpus),
        "ingest_s": ingest_s,
        "scroll": {"chunks": n, "seconds": secs, "chunks_per_s": n / secs},
        "scroll_p10": {"chunks": fn, "seconds": fsecs, "chunks_per_s": fn / fsecs},
        "count": {"none": counts(shard, [], args.counts)},
    }
    for k, share in FIELDS:
        out["count"][f"{k} ({share})"] = counts(shard, [(k, "1")], args.counts)
    shard.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
