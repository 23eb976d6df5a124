#!/usr/bin/env python3
"""Cross-checks `ragctl eval retrieval` against pytrec_eval (trec_eval): scores every TREC run
file of an eval output directory with pytrec_eval and compares each query's nDCG@10,
recall@10/100, MAP@100, P@10 and MRR@10 with the values ragctl wrote to per_query.jsonl.
Prints the largest difference per metric; exits 1 if any exceeds 1e-6.

    python3 scripts/trec_check.py QRELS.tsv EVAL_OUT_DIR
"""
import collections
import json
import sys
from pathlib import Path

import pytrec_eval

qrels_path, out = sys.argv[1], Path(sys.argv[2])
qrels = collections.defaultdict(dict)
for i, line in enumerate(open(qrels_path)):
    f = line.rstrip("\n").split("\t")
    if i == 0 and not f[2].strip().lstrip("-").isdigit():
        continue
    qrels[f[0]][f[1]] = int(f[2])

ours = collections.defaultdict(dict)
for line in open(out / "per_query.jsonl"):
    r = json.loads(line)
    ours[r["config"].replace(":", "_")][r["query_id"]] = r

pairs = {"ndcg@10": "ndcg_cut_10", "recall@10": "recall_10", "recall@100": "recall_100",
         "map@100": "map_cut_100", "p@10": "P_10"}
worst = collections.defaultdict(float)
checked = 0
for run_file in sorted(out.glob("*.trec")):
    config = run_file.stem
    run = collections.defaultdict(dict)
    for line in open(run_file):
        qid, _, doc, rank, score, _ = line.split()
        run[qid][doc] = float(score)
    # Queries with no retrieved document are absent from the run; trec_eval skips them.
    qs = {q: qrels[q] for q in ours[config] if q in run}
    ev = pytrec_eval.RelevanceEvaluator(qs, {"ndcg_cut.10", "recall.10,100", "map_cut.100", "P.10"})
    res = ev.evaluate({q: run[q] for q in qs})
    # MRR@10 = recip_rank over the first 10 documents.
    top10 = {q: dict(sorted(run[q].items(), key=lambda kv: -kv[1])[:10]) for q in qs}
    rr = pytrec_eval.RelevanceEvaluator(qs, {"recip_rank"}).evaluate(top10)
    for q in qs:
        for m, t in pairs.items():
            worst[m] = max(worst[m], abs(ours[config][q][m] - res[q][t]))
        worst["mrr@10"] = max(worst["mrr@10"], abs(ours[config][q]["mrr@10"] - rr[q]["recip_rank"]))
        checked += 1
print(json.dumps({"pytrec_eval": pytrec_eval.__version__ if hasattr(pytrec_eval, "__version__") else "?",
                  "query_runs_checked": checked, "max_abs_diff": worst}))
sys.exit(0 if checked > 0 and max(worst.values()) <= 1e-6 else 1)
