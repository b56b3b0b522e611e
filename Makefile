# Fast-ELECTRA: a thin veneer over `python -m ...`. Each target builds what it needs first.
#   make train                      # whole chain on the embedded default (manifests/tiny.toml)
#   make train MANIFEST=manifests/base.toml        # NPROC: one rank per GPU by default
#   make test
MANIFEST ?= manifests/tiny.toml
DATA     ?=
RUN      ?=
# ranks of the trainer and the aux MLM: one per GPU `nvidia-smi -L` lists, else 1 (the aux model of base trained on
# one of 8 GPUs took 8x as long: `make generate-epochs` trains it first)
# (those CUDA_VISIBLE_DEVICES names where it is set: a scheduler's share of the node); it must divide the batch
ifeq ($(origin NPROC),undefined)
NPROC := $(shell n=$$(nvidia-smi -L 2>/dev/null | grep -c '^GPU '); \
           if [ "$$n" -gt 0 ] 2>/dev/null && [ -n "$${CUDA_VISIBLE_DEVICES+x}" ]; then n=$$(printf '%s' "$$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .); fi; \
           [ "$$n" -gt 0 ] 2>/dev/null && echo $$n || echo 1)
endif
WORKERS  ?=
CORPUS   ?=
# AUX=hf:PATH: an existing masked LM in a local Hugging Face directory as the aux model (needs `pip install -e '.[hf]'`)
AUX      ?=
SWEEP    ?=
TASK     ?= rotten_tomatoes
FT_ARGS  ?=
# make export: the Hugging Face model directory to write (default: RUN/hf)
EXPORT   ?=
PYTEST_ARGS ?=
# bench-efficiency's vocabulary: paper = round(128000 * hidden / 768), the paper's V / d (default), 0 = the data's, or a number
BENCH_VOCAB ?= paper

# the Python that makes .venv (3.11 or newer): PYTHON=python3.12 where the system's python3 is older
PYTHON ?= python3
VENV   := .venv
CPU_TORCH_INDEX := https://download.pytorch.org/whl/cpu
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Default work folder of the manifest (its work_dir, through `extends`), for the file targets below.
MANIFEST_WORK := $(shell $(PYTHON) common/work_dir.py $(MANIFEST) 2>/dev/null)
ifeq ($(MANIFEST_WORK),)
$(error MANIFEST=$(MANIFEST): $(shell $(PYTHON) common/work_dir.py $(MANIFEST) 2>&1 | tail -n 1))
endif
# Your own corpus (CORPUS=...) gets a work folder of its own for everything made from it (corpus, aux model,
# shards, runs), so switching corpora back and forth reuses what each one built.
CORPUS_ID := $(if $(CORPUS),$(notdir $(abspath $(CORPUS)))-$(shell printf '%s' '$(abspath $(CORPUS))' | sha256sum | cut -c1-8))
# An hf: aux model brings its tokenizer, so everything made with it gets a folder of its own too.
# (a trailing slash is the same folder: AUX=hf:/models/x/ gets x's work folder, not a second one named "-HASH")
AUX_PATH := $(patsubst %/,%,$(AUX))
AUX_ID := $(if $(AUX),$(notdir $(patsubst hf:%,%,$(AUX_PATH)))-$(shell printf '%s' '$(AUX_PATH)' | sha256sum | cut -c1-8))
WORK   := $(if $(CORPUS),$(MANIFEST_WORK)/corpora/$(CORPUS_ID),$(MANIFEST_WORK))$(if $(AUX),/aux-models/$(AUX_ID))
SETS   := $(if $(CORPUS),--set corpus.source=$(abspath $(CORPUS))) $(if $(AUX),--set aux.source=$(AUX_PATH)) \
          $(if $(CORPUS)$(AUX),--set work_dir=$(WORK) --set shared_dir=)
DATA_DIR := $(if $(DATA),$(DATA),$(WORK)/epochs)
RUN_DIR  := $(if $(RUN),$(RUN),$(WORK)/runs/default)
SWEEP_DIR := $(if $(SWEEP),$(SWEEP),$(WORK)/sweeps/default)

.PHONY: setup corpus aux generate-epochs train sweep reproduce test test-fast bench bench-aux bench-scale bench-corpus bench-generate bench-train bench-efficiency bench-flops bench-gpu task finetune finetune-floor export plots ablations clean help

help:
	@echo "make train | make test | make test-fast | make setup | make corpus | make aux | make generate-epochs | make sweep"
	@echo "make task | make finetune | make finetune-floor | make export | make reproduce | make plots | make ablations | make clean"
	@echo "make bench | make bench-corpus | make bench-aux | make bench-scale | make bench-generate | make bench-train | make bench-efficiency | make bench-flops | make bench-gpu"
	@echo "variables: MANIFEST=$(MANIFEST) DATA=$(DATA) RUN=$(RUN) SWEEP=$(SWEEP) NPROC=$(NPROC) WORKERS=$(WORKERS) CORPUS=$(CORPUS) AUX=$(AUX) TASK=$(TASK) FT_ARGS=$(FT_ARGS) EXPORT=$(EXPORT) BUDGET=$(BUDGET)"

# A CPU build of torch unless a GPU driver is present: PyPI's Linux torch is the CUDA build (GBs of nvidia
# packages), so torch alone comes from PyTorch's CPU index first (or a wheel pip already finds locally); its
# dependencies, or torch itself where that index cannot be reached, from PyPI.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install --quiet torch; \
	else $(PY) -m pip install --quiet --retries 1 --no-deps torch==2.13.0 --index-url $(CPU_TORCH_INDEX) \
	    2>/dev/null || echo "setup: $(CPU_TORCH_INDEX) not reachable: torch from PyPI"; \
	    $(PY) -m pip install --quiet torch==2.13.0; fi
	$(PY) -m pip install --quiet -e ".[test,hf,tensorboard]"
	touch $(STAMP)

setup: $(STAMP)

corpus: setup
	$(PY) -m corpus --manifest $(MANIFEST) $(SETS) $(if $(WORKERS),--workers $(WORKERS))

# The aux MLM trains in the trainer's loop (objective mlm) on NPROC ranks; a killed run resumes.
aux: corpus
	$(PY) -m auxiliary --manifest $(MANIFEST) $(SETS) --nproc $(NPROC)

generate-epochs: aux
	$(PY) -m generate --manifest $(MANIFEST) $(SETS) --out $(DATA_DIR) $(if $(WORKERS),--workers $(WORKERS))

# One rank runs without a launcher (it dies with make's process group); several under torchrun through
# train/launch.py, so a rank's error ends the command as one line with its exit code (2), not torchrun's 1.
LAUNCH := $(if $(filter 1,$(NPROC)),$(PY),$(PY) -m train.launch --standalone --nproc_per_node $(NPROC))

# Training follows the generation: the generator runs in the background (a finished folder: checked, then done)
# while the trainer waits for each step's shards (train --follow). Its output: GEN_LOG, beside the folder (for
# object storage, in WORK). Ctrl-C or a failed trainer stops the generator too; rerunning resumes both. A generator
# stopped that way did not fail (its exit code then is Ray's: 15, 134 or 143): only one that ended by itself is told.
GEN_LOG := $(if $(findstring ://,$(DATA_DIR)),$(WORK)/generate.log,$(patsubst %/,%,$(DATA_DIR)).generate.log)
# Beside the trainer the generator runs one actor a GPU whatever [generate] actors_per_gpu says (base: 4, for
# `make generate-epochs` alone): the trainer shares each GPU with it, four actors' memory (~30 GiB at base) beside
# the trainer's would not fit a 40 GB card, and one actor already writes faster than the trainer reads.
# SIGUSR1 (README: a run's stacks) must not end this recipe's shell, whose command line names the trainer too
train: aux
	@trap ':' USR1; mkdir -p $(dir $(GEN_LOG)); \
	echo "--- make train, $$(date '+%F %T')" >> $(GEN_LOG); \
	$(PY) -m generate --manifest $(MANIFEST) $(SETS) --set generate.actors_per_gpu=1 --out $(DATA_DIR) \
	    $(if $(WORKERS),--workers $(WORKERS)) \
	    >> $(GEN_LOG) 2>&1 & gen=$$!; \
	trap 'kill $$gen 2>/dev/null; exit 130' INT TERM; \
	echo "generate: writing $(DATA_DIR) in the background (log: $(GEN_LOG)); the trainer follows it"; \
	$(LAUNCH) -m train --manifest $(MANIFEST) $(SETS) --data $(DATA_DIR) --out $(RUN_DIR) --resume \
	    --follow --follow-pid $$gen; rc=$$?; stopped=0; \
	if [ $$rc -ne 0 ]; then kill $$gen 2>/dev/null && stopped=1; fi; wait $$gen; grc=$$?; \
	case "$$stopped:$$grc" in *:0|1:*) ;; *) tail -n 5 $(GEN_LOG) >&2; \
	    echo "error: the generator failed (exit $$grc; log: $(GEN_LOG))" >&2; [ $$rc -ne 0 ] || exit $$grc;; esac; \
	grep '^generate: ' $(GEN_LOG) | tail -n 1; exit $$rc
	@echo "next: make finetune (README: Fine-tuning) | make sweep (Stages) | make train CORPUS=your/texts (Your own corpus) | MANIFEST=manifests/base.toml (Scaling out)"

# Only reads the shards: the generator runs only for the default folder without a manifest.json. A DATA= given
# is taken as it is (one without shards is an error: a mistyped path must not start a generation there).
# The default run (make train's) stands for the grid's combination with its settings, if it finished on them.
sweep: setup $(if $(DATA),,$(DATA_DIR)/manifest.json)
	$(PY) -m experiments.sweep --manifest $(MANIFEST) $(SETS) --data $(DATA_DIR) --out $(SWEEP_DIR) --nproc $(NPROC) \
	    --reuse $(RUN_DIR)

$(DATA_DIR)/manifest.json:
	$(MAKE) generate-epochs MANIFEST=$(MANIFEST) DATA=$(DATA_DIR)

# The paper's curricula: schedules and replaced-token distributions drawn as PNG; every ablation in turn.
plots: aux
	$(PY) -m generate.plots --manifest $(MANIFEST) $(SETS)

ABLATIONS ?= $(wildcard manifests/ablations/*.toml)
ablations: setup
	@for m in $(ABLATIONS); do $(MAKE) train MANIFEST=$$m || exit 1; done

# Fine-tuning (finetune/): the newest checkpoint of RUN on TASK; -floor: random init, same shape.
task: setup
	$(PY) -m finetune.rotten_tomatoes --out work/tasks/rotten_tomatoes

# With RUN= given, that run as it is (never trained further here); without it, the default chain's run.
finetune: $(if $(RUN),setup,train)
	$(PY) -m finetune --checkpoint $(RUN_DIR) --task $(TASK) $(FT_ARGS)

finetune-floor: corpus
	$(PY) -m finetune --init none --manifest $(MANIFEST) --task $(TASK) $(FT_ARGS) $(if $(CORPUS)$(AUX),\
	    --corpus $(WORK)/corpus --out $(WORK)/finetune/$(notdir $(patsubst %/,%,$(TASK)))-none)

# The newest checkpoint of RUN as a Hugging Face model directory (remote code, safetensors, tokenizer, model
# card; needs the .[hf] extra, which setup installs): docs/export.md. Reads the run, trains nothing.
# Without EXPORT=, RUN/hf is make export's own folder: a later export (after more training) replaces it.
export: setup
	$(PY) -m export --run $(RUN_DIR) --out $(if $(EXPORT),$(EXPORT),$(RUN_DIR)/hf --force)

# The paper's claim at small scale: ELECTRA, Fast-ELECTRA, fixed aux, term frequency and no pre-training
# under one wall-clock budget per method (BUDGET seconds; default in manifests/reproduce.toml), each
# checkpoint fine-tuned on Rotten Tomatoes; table + figure in work/reproduce/reproduce.{md,png}.
BUDGET ?=
reproduce: setup
	$(PY) -m experiments.reproduce --manifest manifests/reproduce.toml $(if $(BUDGET),--budget $(BUDGET))

# All benchmarks (ratios measured in one run each; results in bench/results/).
bench: bench-corpus bench-aux bench-scale bench-generate bench-train bench-efficiency bench-flops

bench-generate: generate-epochs
	$(PY) -m bench.generate --manifest $(MANIFEST) --data $(DATA_DIR)

bench-train: generate-epochs
	$(PY) -m bench.train --manifest $(MANIFEST) --data $(DATA_DIR)

bench-efficiency: generate-epochs
	$(PY) -m bench.efficiency --manifest $(MANIFEST) --data $(DATA_DIR) --vocab $(BENCH_VOCAB)

bench-corpus: setup
	$(PY) -m bench.corpus

# The base preset's shape on a GPU (synthetic rows): trainer MFU, fast-offline vs electra, generation vs the
# aux model's forward, FlexAttention vs SDPA; bench/results/base-gpu.{json,md}. Needs CUDA.
bench-gpu: setup
	$(PY) -m bench.gpu --manifest manifests/base.toml

# The aux model's training step at the base preset's aux shape (4 x 768, 128K vocabulary) on CPU: peak RSS with
# 8x the batch at the same micro-batch, and the pre-flight memory estimate against measured peaks.
bench-aux: setup
	$(PY) -m bench.aux --manifest manifests/base.toml --out bench/results

# What grows with the stream, the batch or the shard folder (issue 29's figures): bench/results/scale.{json,md}.
bench-scale: setup
	$(PY) -m bench.scale --out bench/results

bench-flops: setup
	$(PY) -m bench.flops --json bench/results/flops.json --md bench/results/flops.md

# Two test processes (pytest-xdist), one a core: ~10 min on 2 cores instead of ~19 one at a time; a third did
# not pay (docs/benchmarks.md, "The test suite"). TEST_WORKERS=0 runs them in this process, one by one.
# One torch thread per process (TEST_THREADS): two test processes, each starting trainers and actors with a
# thread per core, would run twice as many threads as cores, and idle OpenMP threads spin.
TEST_WORKERS ?= 2
TEST_THREADS ?= 1
test: setup
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

test-fast: setup
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not slow" $(PYTEST_ARGS)

# Everything made under WORK (corpus, aux model, shards, runs, sweeps, exports; hours to days at base): said
# first, deleted with YES=1.
clean:
	@if [ "$(YES)" != 1 ]; then echo "make clean deletes $(WORK) ($$(if [ -e $(WORK) ]; then du -sh $(WORK) | \
	    cut -f1; else echo 'not there'; fi)): its corpus, aux model, shards, runs, sweeps and exports; make clean YES=1 does it" >&2; \
	    exit 2; fi
	rm -rf $(WORK)
