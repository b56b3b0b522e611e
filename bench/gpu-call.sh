#!/bin/bash
# One call on a lent GPU (the device tool's `run`, OUT set): bench.gpu's parts (or tests), each step in its own
# process under its own time limit, logs and results under $OUT, packed into logs.tgz at the end (the device tool
# brings back only a few files). The steps are the next call's plan; docs/benchmarks.md records each call's.
set -u
: "${OUT:?set OUT to the folder that comes back}"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv; command -v nvidia-cuda-mps-control; } \
    > "$OUT/machine.txt" 2>&1
step() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - t0)) s" | tee -a "$OUT/steps.txt"
}
BENCH="python3 -m bench.gpu --manifest manifests/base.toml --rows 32 --accum 4 --steps 10"
# MPS on and off alternated on one machine (session 41's A/B ran in two calls, the host's speed moved between them);
# the aux forward alone, the ratios' reference, once
step forward 120 $BENCH --gen-shards 16 --only generation --out "$OUT/forward"
for round in 1 2; do
    step "processes-$round" 120 $BENCH --gen-processes 4 --gen-shards 48 --only generation_processes \
        --out "$OUT/processes-$round"
    step "processes-mps-$round" 120 $BENCH --mps --gen-processes 4 --gen-shards 48 --only generation_processes \
        --out "$OUT/processes-mps-$round"
done
cd "$OUT" && tar czf logs.tgz --remove-files *.log */base-gpu.json && cd - > /dev/null
cat "$OUT/machine.txt"
for f in "$OUT"/*/base-gpu.md; do echo "== $f"; grep -v "^$" "$f" | tail -n +4; done
