#!/usr/bin/env python3
"""sentence-transformers reference for embedbench (CPU) and gpubench (CUDA, fp32 or fp16):
encodes the same texts at the given batch sizes and prints one JSON object {batch:
sentences_per_second}. The benches run it in the same session, with the same thread count
and device, so the ratios compare like with like.

    python3 scripts/st_embed_bench.py MODEL_DIR TEXTS.json 1,8,32,128 THREADS [cpu|cuda] [fp32|fp16] [COUNT]

Each batch size encodes the first COUNT texts (default: max(4 x batch, 64)).
"""
import json
import sys
import time

import torch
from sentence_transformers import SentenceTransformer

model_dir, texts_path, batches, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.set_num_threads(threads)
texts = json.load(open(texts_path))
device = sys.argv[5] if len(sys.argv) > 5 else "cpu"
dtype = sys.argv[6] if len(sys.argv) > 6 else "fp32"
model = SentenceTransformer(model_dir, device=device)
if dtype == "fp16":
    model = model.half()
model.encode(texts[:64], batch_size=32)  # warm-up
out = {"torch": torch.__version__, "threads": threads, "device": device, "dtype": dtype,
       "sentences_per_s": {}}
count = int(sys.argv[7]) if len(sys.argv) > 7 else 0
for b in [int(x) for x in batches.split(",")]:
    n = min(len(texts), count or max(b * 4, 64))
    start = time.perf_counter()
    model.encode(texts[:n], batch_size=b, normalize_embeddings=True)
    out["sentences_per_s"][str(b)] = n / (time.perf_counter() - start)
print(json.dumps(out))
