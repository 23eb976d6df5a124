#!/usr/bin/env python3
"""Produces the reference embeddings that model-worker's test compares against.

Run once with sentence-transformers (CPU is fine) and commit the output:
    python3 scripts/reference_embeddings.py models/all-MiniLM-L6-v2 > model-worker/tests/data/minilm_reference.json
"""
import json
import sys

import sentence_transformers
from sentence_transformers import SentenceTransformer

SENTENCES = [
    "The cat sits outside.",
    "A man is playing guitar.",
    "Raft elects a leader by majority vote before it replicates the log.",
    "BM25 saturates term frequency and normalises by document length; HNSW answers nearest-neighbour queries over embeddings.",
    "Émile Zola wrote Germinal in 1885 — über große Minen.",
    " ".join(["long input that exceeds the maximum sequence length"] * 60),
]

model = SentenceTransformer(sys.argv[1], device="cpu")
emb = model.encode(SENTENCES, normalize_embeddings=True, batch_size=8)
json.dump(
    {
        "model": "sentence-transformers/all-MiniLM-L6-v2",
        "produced_with": f"sentence-transformers {sentence_transformers.__version__}",
        "max_seq_length": model.max_seq_length,
        "sentences": SENTENCES,
        "embeddings": [[round(float(x), 7) for x in v] for v in emb],
    },
    sys.stdout,
)
