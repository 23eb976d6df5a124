#!/usr/bin/env python3
"""transformers reference for gpubench's generation figures: SmolLM2's GGUF loaded through
transformers' GGUF support (needs the `gguf` wheel), fp16 on CUDA, greedy. For each batch
size: time to first token (a 1-token generate) and decode tokens/s over N new tokens after
the chat-templated prompt. Prints one JSON object.

    python3 scripts/hf_generate_bench.py MODEL.gguf PROMPT 1,8,64 NEW_TOKENS
"""
import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf, prompt, batches, new = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
folder, name = os.path.dirname(gguf), os.path.basename(gguf)
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
tok.padding_side = "left"
if tok.pad_token is None:
    tok.pad_token = tok.eos_token
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float16)
model = model.to("cuda").eval()
chat = tok.apply_chat_template(
    [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
)


def timed(enc, tokens):
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


result = {"torch": torch.__version__, "dtype": "fp16", "new_tokens": new}
timed(tok([chat], return_tensors="pt").to("cuda"), 4)  # warm-up
for b in [int(x) for x in batches.split(",")]:
    enc = tok([chat] * b, return_tensors="pt", padding=True).to("cuda")
    _, first = timed(enc, 1)
    out, wall = timed(enc, new)
    made = (out.shape[1] - enc["input_ids"].shape[1]) * b
    result[f"streams_{b}"] = {
        "tokens_per_s": made / wall,
        "decode_tokens_per_s_per_stream": (made / b - 1) / max(wall - first, 1e-9),
        "ttft_ms": first * 1e3,
        "prompt_tokens": enc["input_ids"].shape[1],
    }
print(json.dumps(result))
