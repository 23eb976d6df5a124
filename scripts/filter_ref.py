#!/usr/bin/env python3
"""The Qdrant engine in process (qdrant-edge-py, one EdgeShard with its defaults: HNSW M 16,
ef_construct 100, full-scan threshold 10,000 KB) doing filtered dense search on the corpus
that `filterbench --engines PYTHON` exports: the reference rows of issue 69's filtered-search
target, on the same machine in the same run.

Point i holds its vector and the keyword payload fields p2, p10, p100 and p1000 (value
str(i mod k)), each with a keyword payload index (so Qdrant plans by cardinality and builds
its extra filtered-graph links). For no filter and each field = "1" (50%, 10%, 1%, 0.1%):
one client query by query (p50 / p99), then `--concurrency` threads for at least
`--qps-seconds` (QPS), and recall@10 against the exact filtered top 10 the benchmark wrote.

Input (`--dir`): vectors.f32, query_vectors.f32, meta.json ({"chunks","queries","dim"}) and
exact_<field>.jsonl (chunk indexes of each query's exact top 10; "none" for no filter).
Prints one JSON object. Setup: `bash scripts/setup-bench-python.sh --engines`.
"""

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np
import qdrant_edge as qe
from engines_bench import measure  # the same client loop as the other reference rows

FIELDS = [("p2", 2), ("p10", 10), ("p100", 100), ("p1000", 1000)]
TOP_K = 10


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--qps-seconds", type=float, default=3.0)
    args = p.parse_args()
    meta = json.load(open(os.path.join(args.dir, "meta.json")))
    dim = meta["dim"]
    vectors = np.fromfile(os.path.join(args.dir, "vectors.f32"), dtype="<f4").reshape(-1, dim)
    qvecs = np.fromfile(os.path.join(args.dir, "query_vectors.f32"), dtype="<f4").reshape(-1, dim)
    work = tempfile.mkdtemp(prefix="filter-ref-")
    try:
        config = qe.EdgeConfig(
            vectors={"dense": qe.EdgeVectorParams(size=dim, distance=qe.Distance.Cosine)}
        )
        shard = qe.EdgeShard.create(os.path.join(work, "qdrant"), config)
        for k, _ in FIELDS:
            shard.update(qe.UpdateOperation.create_field_index(k, qe.PayloadSchemaType.Keyword))
        t = time.perf_counter()
        for s in range(0, len(vectors), 512):
            points = [
                qe.Point(
                    id=i,
                    vector={"dense": vectors[i].tolist()},
                    payload={k: str(i % m) for k, m in FIELDS},
                )
                for i in range(s, min(s + 512, len(vectors)))
            ]
            shard.update(qe.UpdateOperation.upsert_points(points))
        shard.flush()
        shard.optimize()
        out = {"chunks": len(vectors), "ingest_s": time.perf_counter() - t}
        dense_q = [v.tolist() for v in qvecs]
        for name in ["none"] + [k for k, _ in FIELDS]:
            flt = None
            if name != "none":
                flt = qe.Filter(
                    must=[qe.FieldCondition(key=name, match=qe.MatchValue(value="1"))]
                )

            def run(i, flt=flt):
                req = qe.QueryRequest(
                    limit=TOP_K,
                    query=qe.Query.Nearest(dense_q[i], using="dense"),
                    filter=flt,
                    with_payload=False,
                )
                return [p.id for p in shard.query(req)]

            row, top = measure(run, len(dense_q), args.concurrency, args.qps_seconds)
            exact = [json.loads(line) for line in open(os.path.join(args.dir, f"exact_{name}.jsonl"))]
            hit = sum(len(set(g) & set(e)) / TOP_K for e, g in zip(exact, top))
            row["recall@10"] = hit / max(1, len(exact))
            out[name] = row
        shard.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
