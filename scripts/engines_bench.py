#!/usr/bin/env python3
"""The engines a user would pick instead of ragcluster, measured in process on the corpus and
queries that `scalebench --engines PYTHON` exports, so both sides run on one machine in one
run (issue 20's reference rows):

- tantivy-py (BM25): the same analysis as the shard's BM25 index (simple tokenizer, long
  tokens dropped, lowercase, English stop words, English stemmer), the query's terms OR-ed,
  top 10 with the chunk ids read from the doc store;
- the Qdrant engine in process (qdrant-edge-py, one EdgeShard with its defaults): dense
  (cosine), BM25 as a sparse vector with the IDF modifier (its `Bm25` model), hybrid RRF
  (k 60) and DBSF over 50 candidates per retriever, as ragcluster's hybrid search.

Per mode: p50/p99 of one client query by query, then `--concurrency` threads for at least
`--qps-seconds` (QPS, and this process's CPU per query, client loop included), and dense
recall@10 against the exported brute-force top 10. Prints one JSON object.

Setup: `bash scripts/setup-bench-python.sh --engines` (a venv with qdrant-edge-py, tantivy
and numpy). Input (`--dir`): corpus.jsonl ({"id","text"}), vectors.f32, queries.jsonl
({"text"}), query_vectors.f32, exact.jsonl (the ids of each query's exact top 10) and
meta.json ({"chunks","queries","dim"}).
"""

import argparse
import json
import os
import resource
import shutil
import tempfile
import threading
import time

import numpy as np
import qdrant_edge as qe
import tantivy

TOP_K = 10
CANDIDATES = 50  # ragcluster's DEFAULT_CANDIDATES for hybrid search
RRF_K = 60


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def percentile(xs, p):
    xs = sorted(xs)
    if not xs:
        return 0.0
    i = min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))
    return xs[i]


def measure(run, n_queries, concurrency, qps_seconds):
    """One client query by query, then `concurrency` threads cycling through the queries for
    at least `qps_seconds`; `run(i)` answers query i and returns its ids."""
    for i in range(min(20, n_queries)):
        run(i)
    lat, top = [], []
    for i in range(n_queries):
        t = time.perf_counter()
        top.append(run(i))
        lat.append((time.perf_counter() - t) * 1e3)
    sent = [0] * concurrency
    start = time.perf_counter()
    end = start + qps_seconds

    def client(k):
        i, n = k, 0
        while time.perf_counter() < end or i < n_queries:
            run(i % n_queries)
            i += concurrency
            n += 1
        sent[k] = n

    cpu0 = cpu_seconds()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    cpu = cpu_seconds() - cpu0
    n = sum(sent)
    row = {
        "p50_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "qps": n / wall,
        "qps_queries": n,
        "cpu_ms_per_query": 1e3 * cpu / n,
    }
    return row, top


def recall(exact, top):
    hit = sum(len(set(g) & set(e)) / TOP_K for e, g in zip(exact, top))
    return hit / max(1, len(exact))


def load(d):
    meta = json.load(open(os.path.join(d, "meta.json")))
    corpus = [json.loads(line) for line in open(os.path.join(d, "corpus.jsonl"))]
    queries = [json.loads(line)["text"] for line in open(os.path.join(d, "queries.jsonl"))]
    exact = [json.loads(line) for line in open(os.path.join(d, "exact.jsonl"))]
    dim = meta["dim"]
    vectors = np.fromfile(os.path.join(d, "vectors.f32"), dtype="<f4").reshape(-1, dim)
    qvecs = np.fromfile(os.path.join(d, "query_vectors.f32"), dtype="<f4").reshape(-1, dim)
    assert len(corpus) == len(vectors) == meta["chunks"], "corpus and vectors disagree"
    assert len(queries) == len(qvecs) == len(exact) == meta["queries"], "queries disagree"
    return corpus, vectors, queries, qvecs, exact


def analyzer():
    return (
        tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
        .filter(tantivy.Filter.remove_long(40))
        .filter(tantivy.Filter.lowercase())
        .filter(tantivy.Filter.stopword("english"))
        .filter(tantivy.Filter.stemmer("english"))
        .build()
    )


def bench_tantivy(corpus, queries, args, work):
    sb = tantivy.SchemaBuilder()
    sb.add_text_field("id", stored=True, tokenizer_name="raw")
    sb.add_text_field("body", stored=False, tokenizer_name="ragcluster_en", index_option="freq")
    schema = sb.build()
    path = os.path.join(work, "tantivy")
    os.makedirs(path)
    index = tantivy.Index(schema, path=path)
    index.register_tokenizer("ragcluster_en", analyzer())
    t = time.perf_counter()
    writer = index.writer(heap_size=256_000_000, num_threads=1)
    for c in corpus:
        writer.add_document(tantivy.Document(id=c["id"], body=c["text"]))
    writer.commit()
    writer.wait_merging_threads()
    ingest_s = time.perf_counter() - t
    index.reload()
    searcher = index.searcher()
    an = analyzer()
    parsed = []
    for q in queries:
        terms = an.analyze(q)
        parsed.append(
            tantivy.Query.boolean_query(
                [(tantivy.Occur.Should, tantivy.Query.term_query(schema, "body", t)) for t in terms]
            )
        )

    def run(i):
        hits = searcher.search(parsed[i], TOP_K).hits
        return [searcher.doc(addr)["id"][0] for _, addr in hits]

    row, _ = measure(run, len(queries), args.concurrency, args.qps_seconds)
    return {
        "ingest_s": ingest_s,
        "segments": searcher.num_segments,
        "bm25": row,
        "note": "query terms analysed once up front (as ragcluster's shard does per query, "
        "inside its CPU figure); ids read from the doc store",
    }


def bench_qdrant(corpus, vectors, queries, qvecs, exact, args, work):
    path = os.path.join(work, "qdrant")
    config = qe.EdgeConfig(
        vectors={"dense": qe.EdgeVectorParams(size=vectors.shape[1], distance=qe.Distance.Cosine)},
        sparse_vectors={"bm25": qe.EdgeSparseVectorParams(modifier=qe.Modifier.Idf)},
    )
    shard = qe.EdgeShard.create(path, config)
    bm25 = qe.Bm25(qe.Bm25Config(language="english"))
    t = time.perf_counter()
    batch = 512
    for s in range(0, len(corpus), batch):
        points = [
            qe.Point(
                id=s + j,
                vector={"dense": vectors[s + j].tolist(), "bm25": bm25.embed_document(c["text"])},
                payload={"chunk_id": c["id"]},
            )
            for j, c in enumerate(corpus[s : s + batch])
        ]
        shard.update(qe.UpdateOperation.upsert_points(points))
    shard.flush()
    upsert_s = time.perf_counter() - t
    t = time.perf_counter()
    shard.optimize()
    optimize_s = time.perf_counter() - t
    info = shard.info()
    ids = [c["id"] for c in corpus]
    sparse_q = [bm25.embed_query(q) for q in queries]
    dense_q = [v.tolist() for v in qvecs]

    def answer(req):
        return [ids[p.id] for p in shard.query(req)]

    def dense_req(i, ef=None, limit=TOP_K):
        params = qe.SearchParams(hnsw_ef=ef) if ef else None
        return qe.QueryRequest(
            limit=limit,
            query=qe.Query.Nearest(dense_q[i], using="dense"),
            params=params,
            with_payload=False,
        )

    def sparse_req(i, limit=TOP_K):
        return qe.QueryRequest(
            limit=limit, query=qe.Query.Nearest(sparse_q[i], using="bm25"), with_payload=False
        )

    def hybrid_req(i, fusion):
        pre = [
            qe.Prefetch(limit=CANDIDATES, query=qe.Query.Nearest(dense_q[i], using="dense")),
            qe.Prefetch(limit=CANDIDATES, query=qe.Query.Nearest(sparse_q[i], using="bm25")),
        ]
        return qe.QueryRequest(limit=TOP_K, prefetches=pre, query=fusion, with_payload=False)

    out = {
        "upsert_s": upsert_s,
        "optimize_s": optimize_s,
        "segments": info.segments_count,
        "points": info.points_count,
        "indexed_vectors": info.indexed_vectors_count,
    }
    modes = [("dense", lambda i: answer(dense_req(i)))]
    if not args.dense_only:
        modes += [
            ("bm25", lambda i: answer(sparse_req(i))),
            ("hybrid-rrf", lambda i: answer(hybrid_req(i, qe.Fusion.Rrf(k=RRF_K)))),
            ("hybrid-dbsf", lambda i: answer(hybrid_req(i, qe.Fusion.Dbsf()))),
        ]
    for ef in args.dense_ef:
        modes.append((f"dense_ef{ef}", lambda i, ef=ef: answer(dense_req(i, ef))))
    for name, run in modes:
        row, top = measure(run, len(queries), args.concurrency, args.qps_seconds)
        if name.startswith("dense"):
            row["recall@10"] = recall(exact, top)
        out[name] = row
    shard.close()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--qps-seconds", type=float, default=3.0)
    p.add_argument("--dense-ef", default="64,128,256")
    p.add_argument("--dense-only", action="store_true")
    args = p.parse_args()
    args.dense_ef = [int(x) for x in args.dense_ef.split(",") if x]
    corpus, vectors, queries, qvecs, exact = load(args.dir)
    work = tempfile.mkdtemp(prefix="engines-")
    try:
        out = {
            "versions": {
                "tantivy-py": _version("tantivy"),
                "qdrant-edge-py": _version("qdrant-edge-py"),
            },
            "chunks": len(corpus),
            "queries": len(queries),
            "concurrency": args.concurrency,
        }
        if not args.dense_only:
            out["tantivy"] = bench_tantivy(corpus, queries, args, work)
        out["qdrant_edge"] = bench_qdrant(corpus, vectors, queries, qvecs, exact, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))


def _version(dist):
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001 (a version is a label, never a failure)
        return "unknown"


if __name__ == "__main__":
    main()
