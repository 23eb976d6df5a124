#!/usr/bin/env bash
# Writes model-worker/tests/data/nomic_llamacpp.json: nomic-embed-text-v1.5's embeddings of a
# few texts as llama.cpp computes them (`llama-embedding`, mean pooling, L2-normalised), the
# independent reference model-worker/tests/nomic.rs checks our encoder against. Run once after
# `scripts/fetch-models.sh nomic`; llama.cpp is built by scripts/build-llama-bench.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
models="${RAGCLUSTER_MODELS:-$PWD/models}"
bin="$(dirname "$(bash scripts/build-llama-bench.sh)")/llama-embedding"
out=model-worker/tests/data/nomic_llamacpp.json
python3 - "$bin" "$models/nomic-embed-text-v1.5.f16.gguf" "$out" <<'PY'
import json, subprocess, sys
bin, model, out = sys.argv[1:]
long = " ".join(
    f"Paragraph {i}: a shard replica keeps its chunks in RocksDB, its vectors in an HNSW graph "
    f"and its terms in a tantivy index, and a Raft group of {i % 5 + 3} members agrees on "
    "every write before it is acknowledged to the client."
    for i in range(12))
texts = [
    "search_query: How does Raft elect a leader?",
    "search_document: Raft elects a leader with randomized election timeouts: a follower that "
    "hears no heartbeat becomes a candidate, votes for itself and asks the others for votes.",
    "search_document: The lighthouse of Varnholm was built in 1873 by the engineer Edda Quist.",
    "search_document: " + long,
]
r = subprocess.run([bin, "-m", model, "-p", "\n".join(texts), "-c", "2048", "-b", "2048",
                    "-ub", "2048", "--pooling", "mean", "--embd-normalize", "2",
                    "--embd-output-format", "json", "-t", "2", "--no-warmup"],
                   capture_output=True, text=True, check=True)
data = json.loads(r.stdout[r.stdout.index("{"):])["data"]
version = subprocess.run([bin, "--version"], capture_output=True, text=True).stderr.splitlines()[0]
json.dump({
    "generator": f"llama.cpp llama-embedding ({version}; the llama.cpp vendored by "
                 "llama-cpp-python 0.3.36), --pooling mean --embd-normalize 2, f16 weights, CPU",
    "model": "nomic-embed-text-v1.5.f16.gguf sha256 f7af6f66802f4df86eda10fe9bbcfc75c39562bed48ef6ace719a251cf1c2fdb",
    "texts": texts,
    "embeddings": [[round(x, 6) for x in d["embedding"]] for d in data],
}, open(out, "w"), indent=None)
print(f"{out}: {len(data)} embeddings of {len(data[0]['embedding'])} values ({version})")
PY
