# The index of commands. CARGO_TARGET_DIR lives outside the clone so rebuilds (and CI) stay
# incremental; everything builds with the one release profile.
export CARGO_TARGET_DIR ?= $(HOME)/.cache/ragcluster-target
BIN := $(CARGO_TARGET_DIR)/release

.PHONY: images compose-up compose-down setup build build-demo demo test test-faults test-sim test-unit test-cluster lint fmt bench bench-restart bench-raft bench-gen bench-cpu-decode bench-embed-nomic bench-gpu bench-embed bench-ask bench-quick eval-scifact up down fuzz bench-security bench-chunks bench-hnsw bench-scale bench-engines bench-bm25 bench-tokenize bench-ingest bench-browse bench-filter bench-update bench-backup bench-reembed bench-chunking bench-sampling bench-prefix

setup:            ## system packages + models
	bash scripts/setup.sh

build:
	cargo build --release --workspace

# Only the four binaries the demo runs (a cold build skips the benchmarks and tests).
build-demo:
	cargo build --release -p coordinator -p shard-node -p model-worker -p ragctl --bins

demo: build-demo  ## the main job: local cluster, ingest the sample docs, answer a query
	$(BIN)/ragctl local up
	$(BIN)/ragctl ingest docs/sample
	$(BIN)/ragctl search "how does raft elect a leader?"
	$(BIN)/ragctl ask "How does Raft elect a leader?"

up: build-demo
	$(BIN)/ragctl local up

down:
	$(BIN)/ragctl local down

# Tests run binaries with failpoints (a cargo feature, never in `build`): partitions and
# corrupted snapshots in the Raft fault tests.
TEST_FEATURES := --features shard-node/failpoints

# NVRTC from scripts/setup.sh: the unit tests compile every CUDA kernel with it (no GPU needed).
NVRTC_LIB := $(HOME)/.cache/ragcluster-nvrtc/lib

test:             ## every test, layer by layer (scripts/test.sh): time per layer and skips at the end
	bash scripts/test.sh

test-faults:       ## Raft fault schedules with linearizability checks: 200 random seeds (CI runs 20); index-task crash points: 45 seeds (CI runs 9); damaged files (WAL, SST, tantivy, HNSW); full disks; wall-clock jumps; network partitions between namespaces: 3 rounds (CI runs 1)
	cargo build --release --workspace $(TEST_FEATURES)
	RAGCLUSTER_FAULT_SEEDS=200 cargo test --release --workspace $(TEST_FEATURES) --test raft -- --nocapture
	RAGCLUSTER_CRASH_SEEDS=45 cargo test --release --workspace $(TEST_FEATURES) --test crash_recovery -- --nocapture
	cargo test --release --workspace $(TEST_FEATURES) --test damaged --test disk_full --test clock -- --nocapture
	RAGCLUSTER_NET_ROUNDS=3 cargo test --release --workspace $(TEST_FEATURES) --test partitions -- --nocapture

test-sim:          ## deterministic Raft simulation: 5000 seeds (CI runs 500); SEED=N reruns one seed with a trace
	RAFT_SIM_SEEDS=$(or $(SEEDS),5000) RAFT_SIM_SEED=$(SEED) cargo test --release --workspace $(TEST_FEATURES) --test sim -- --nocapture

test-unit:
	cargo test --release --workspace $(TEST_FEATURES) --lib --bins

lint:
	cargo fmt --all -- --check
	cargo clippy --release --workspace --all-targets $(TEST_FEATURES) -- -D warnings

fmt:
	cargo fmt --all

bench: build      ## full SciFact quality + latency + 100k scale + restart (~30 min)
	mkdir -p bench-out
	$(BIN)/ragbench --out bench-out/scifact.json

bench-restart: bench-chunks ## kill -9 and SIGTERM restart of a node holding 100k chunks, disk per chunk by place
	$(BIN)/ragbench --load-chunks bench-out/scifact-chunks.pb --only-restart --scale-chunks 100000 --out bench-out/restart.json

bench-chunks: build ## SciFact chunks + MiniLM vectors saved for the benches below (~16 min, once)
	mkdir -p bench-out
	test -f bench-out/scifact-chunks.pb || $(BIN)/ragbench --scale-chunks 0 --skip-quality --skip-restart --dump-chunks bench-out/scifact-chunks.pb

bench-hnsw: bench-chunks ## the HNSW walk in process at 100k: portable vs AVX2 distance, filtered vs plain walk, the shard's index
	$(BIN)/hnswbench --points 100000 --out bench-out/hnsw.json

bench-scale: bench-chunks ## scale curve 10k / 100k / 1M chunks: ingest, p50/p99/QPS per mode, recall, RAM and disk per chunk
	$(BIN)/scalebench --sizes 10000,100000,1000000 --out bench-out/scale.json

# A Python with tantivy-py and qdrant-edge-py: `bash scripts/setup-bench-python.sh --engines`.
ENGINES_PYTHON ?= $(HOME)/.cache/engines-venv/bin/python

bench-engines: bench-chunks ## whole SciFact at 1 and 3 shards, then 100k dense, each beside tantivy-py and the Qdrant engine in process
	$(BIN)/scalebench --sizes 11235 --shards 1 --engines $(ENGINES_PYTHON) --out bench-out/engines-1shard.json
	$(BIN)/scalebench --sizes 11235 --shards 3 --engines $(ENGINES_PYTHON) --out bench-out/engines-3shards.json
	$(BIN)/scalebench --sizes 100000 --dense-only-above 11235 --dense-ef 64,128 --engines $(ENGINES_PYTHON) --out bench-out/engines-100k.json
	$(BIN)/scalebench --sizes 11235 --shards 1 --shard-nodes 0 --colocated --engines $(ENGINES_PYTHON) --out bench-out/engines-1shard-colocated.json

bench-bm25: bench-chunks ## one shard's BM25 in process: block-WAND vs scoring every match at 11k and 100k chunks
	$(BIN)/bm25bench --sizes 11235,100000 > bench-out/bm25.json

bench-security: build ## search latency/QPS and new connections: plaintext vs mutual TLS + API keys
	$(BIN)/securitybench

bench-raft: build ## write throughput + commit latency (rf 1 vs 3), snapshot transfer rate
	$(BIN)/raftbench --docs 5000

bench-cpu-decode: build  ## the CPU decoder (quantized kernels and f32) against llama.cpp's llama-bench on the same GGUF: pp512 / tg128 tokens/s, memory
	$(BIN)/cpudecodebench --prompt 512 --tokens 128 --llama-bench "$$(bash scripts/build-llama-bench.sh)"

bench-embed-nomic: build  ## nomic-embed-text-v1.5 on our CPU encoder against llama.cpp's llama-embedding on the same GGUF: passages/s, tokens/s, cosine agreement
	$(BIN)/nomicbench --passages 256 --llama-embedding "$$(dirname "$$(bash scripts/build-llama-bench.sh)")/llama-embedding"

bench-gen: build  ## generation tokens/s, 1 vs 8 streams, f16 / f32 / quantized weights
	$(BIN)/genbench

bench-gpu: build  ## every model-worker figure of the GPU issue in one run (CUDA encoder, served Embed, generation, references)
	$(BIN)/gpubench --python "$${RAGCLUSTER_PYTHON:-python3}" --cluster

bench-embed: build ## MiniLM sentences/s vs sentence-transformers at batch 1/8/32/128; 64 clients, batching on vs off
	$(BIN)/embedbench --python "$${RAGCLUSTER_PYTHON:-python3}"

bench-tokenize: build ## Embed calls of 16 MB: their latency, and health checks / small calls beside them
	$(BIN)/tokenbench

bench-browse: build ## Scroll and Count at 100k and 1M chunks (3 shards): chunks/s, count p50/p99 per filter selectivity; beside the Qdrant engine when ENGINES_PYTHON has qdrant-edge-py
	mkdir -p bench-out
	$(BIN)/browsebench --sizes 100000,1000000 $(if $(wildcard $(ENGINES_PYTHON)),--engines $(ENGINES_PYTHON)) --out bench-out/browse.json

bench-update: ## partial updates: UpdateDocuments by ids and by filter against re-upserting whole documents (vectors reused / re-embedded), delete by filter, 2,000 SciFact abstracts, beside the Qdrant engine
	$(BIN)/updatebench $(if $(wildcard $(ENGINES_PYTHON)),--engines $(ENGINES_PYTHON)) --out bench-out/update.json

bench-backup: bench-chunks ## backup under a write load and restore into a fresh one-node cluster, 200k SciFact chunks (BACKUP_CHUNKS=1000000: ~22 min): times, writes acknowledged before the backup all restored, top 10 agreement (approximate and exact) over 300 queries
	$(BIN)/backupbench --size $${BACKUP_CHUNKS:-200000} --out bench-out/backup.json

bench-reembed: ## re-embedding a live SciFact collection MiniLM -> nomic-embed-text-v1.5 while 8 clients search and 2 write through its alias: failed calls, copy and switch times, acknowledged writes in the new collection, nDCG@10 of both
	$(BIN)/reembedbench --limit-docs $${REEMBED_DOCS:-300} --out bench-out/reembed.json

bench-filter: bench-chunks ## filtered dense search at 100k chunks, keyword filters matching 50/10/1/0.1%: recall@10 and QPS at 8 clients, 3 shards and 1 colocated shard (also ids only over the coordinator's Unix socket), beside the Qdrant engine
	$(BIN)/filterbench $(if $(wildcard $(ENGINES_PYTHON)),--engines $(ENGINES_PYTHON)) --out bench-out/filter.json
	$(BIN)/filterbench --shards 1 --shard-nodes 0 --colocated $(if $(wildcard $(ENGINES_PYTHON)),--engines $(ENGINES_PYTHON)) --out bench-out/filter-colocated.json
	$(BIN)/filterbench --shards 1 --shard-nodes 0 --colocated --ids-only --unix $(if $(wildcard $(ENGINES_PYTHON)),--engines $(ENGINES_PYTHON)) --out bench-out/filter-colocated-unix.json

bench-ingest: build ## ragctl ingest of SciFact end to end: with the model, then with the model excluded (embedding cache)
	mkdir -p bench-out
	$(BIN)/ingestbench --out bench-out/ingest.json

bench-ask: build  ## Ask latency per operator (p50/p99) for every example flow; engine overhead
	mkdir -p bench-out
	$(BIN)/askbench --out bench-out/ask.json

eval-scifact: build ## retrieval quality of every search mode on SciFact (ingests it into a local cluster)
	$(BIN)/ragctl local up
	$(BIN)/ragctl eval retrieval --collection scifact --ingest --dataset $${RAGCLUSTER_DATASETS:-../shared/datasets}/scifact --out bench-out/eval-scifact

bench-chunking: build ## the coordinator's chunker over SciFact: whole-text tokenizer vs per-run cache
	$(BIN)/chunkbench --passes 3

bench-prefix: build ## the model worker's prefix cache against none: worked-example answer prompts and multi-turn chats, Qwen 0.5B on the CPU
	RAGCLUSTER_GENERATE_MODEL=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf $(BIN)/prefixbench

bench-sampling: build ## a sampled token's cost per row of SmolLM2 logits: the engine's sampler vs candle's LogitsProcessor
	$(BIN)/samplebench

bench-quick: build
	$(BIN)/ragbench --docs 500 --scale-chunks 5000

fuzz:             ## every cargo-fuzz target for FUZZ_SECONDS (default 60) each, nightly
	bash scripts/fuzz.sh

images:           ## container images FROM scratch (ragcluster/*:$$TAG, default dev)
	bash deploy/build-images.sh

compose-up: images ## coordinator, 3 shard nodes, model worker in Docker (client port 127.0.0.1:7000)
	docker-compose -f deploy/compose.yaml up -d

compose-down:
	docker-compose -f deploy/compose.yaml down
