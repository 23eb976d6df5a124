#!/usr/bin/env python3
"""The Qdrant engine in process (qdrant-edge-py, one EdgeShard with its defaults) changing
payloads the way `updatebench --engines PYTHON` changes our documents: the reference rows of
issue 69's partial updates, on the same machine in the same run.

Document d holds as many points as we stored chunks for it (`--docs-file`: a JSON list of
chunk counts), each with a random unit vector of 384 floats (a payload change does not read
vectors), the keyword payload `bucket` = str(d mod 10) (with a keyword payload index) and the
integer payload `rev`. Measured: set_payload `rev` on the points of `--batch` documents at a
time over all documents (documents/s, p50 / p99 per call), set_payload by the filter
bucket = k (10% of the documents), `--filter-calls` calls, and delete by filter (bucket = 9).
The engine's update returns once its write-ahead log has the operation, in process; ours
once a Raft quorum has it fsynced and the indexes show it, through gRPC.

Prints one JSON object. Setup: `bash scripts/setup-bench-python.sh --engines`.
"""

import argparse
import json
import os
import shutil
import time

import numpy as np
import qdrant_edge as qe

DIM = 384


def summary(lat):
    lat = sorted(lat)

    def pct(p):
        return lat[min(len(lat) - 1, max(0, int(np.ceil(p / 100 * len(lat))) - 1))]

    return {"n": len(lat), "p50_ms": pct(50), "p99_ms": pct(99), "max_ms": lat[-1]}


def bucket(k):
    return qe.Filter(must=[qe.FieldCondition(key="bucket", match=qe.MatchValue(value=str(k)))])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs-file", required=True)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--filter-calls", type=int, default=10)
    p.add_argument("--work", required=True)
    args = p.parse_args()
    per_doc = json.load(open(args.docs_file))
    points_of = []
    next_id = 0
    for n in per_doc:
        points_of.append(list(range(next_id, next_id + n)))
        next_id += n
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((next_id, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    config = qe.EdgeConfig(vectors={"dense": qe.EdgeVectorParams(size=DIM, distance=qe.Distance.Cosine)})
    shard = qe.EdgeShard.create(os.path.join(args.work, "qdrant"), config)
    shard.update(qe.UpdateOperation.create_field_index("bucket", qe.PayloadSchemaType.Keyword))
    points = [
        qe.Point(id=pid, vector={"dense": vectors[pid].tolist()}, payload={"bucket": str(d % 10), "rev": 0})
        for d, ids in enumerate(points_of)
        for pid in ids
    ]
    for s in range(0, len(points), 512):
        shard.update(qe.UpdateOperation.upsert_points(points[s : s + 512]))
    shard.flush()
    shard.optimize()
    out = {"docs": len(per_doc), "points": next_id}

    lat = []
    t = time.perf_counter()
    for s in range(0, len(points_of), args.batch):
        ids = [pid for ids in points_of[s : s + args.batch] for pid in ids]
        c = time.perf_counter()
        shard.update(qe.UpdateOperation.set_payload(ids, {"rev": 1}))
        lat.append((time.perf_counter() - c) * 1000)
    secs = time.perf_counter() - t
    out["update_by_ids"] = {"docs_per_s": len(per_doc) / secs, "seconds": secs, "per_call_ms": summary(lat)}

    lat = []
    for k in range(args.filter_calls):
        c = time.perf_counter()
        shard.update(qe.UpdateOperation.set_payload_by_filter(bucket(k % 10), {"rev": 2}))
        lat.append((time.perf_counter() - c) * 1000)
    per_call = sum(1 for d in range(len(per_doc)) if d % 10 == 0)
    out["update_by_filter_10pct"] = {
        "docs_per_call": per_call,
        "docs_per_s": per_call * len(lat) / (sum(lat) / 1000),
        "per_call_ms": summary(lat),
    }

    c = time.perf_counter()
    shard.update(qe.UpdateOperation.delete_points_by_filter(bucket(9)))
    out["delete_by_filter_10pct"] = {"ms": (time.perf_counter() - c) * 1000}
    left = shard.count(qe.CountRequest(exact=True))
    out["points_left"] = left
    print(json.dumps(out))


if __name__ == "__main__":
    main()
