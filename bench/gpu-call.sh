#!/bin/bash
# One call on a lent GPU (the device tool's `run`, OUT set): the attention tests on the GPU, then bench.gpu's
# parts, each in its own process under its own time limit, logs and results under $OUT. Edit the parts for the
# session's question; docs/benchmarks.md records each call's command and figures.
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
step trainer-new 100 $BENCH --only mfu_compiled --profile --out "$OUT/trainer-new"
step trainer-old 100 $BENCH --only mfu_compiled_inductor_embedding --profile --out "$OUT/trainer-old"
cd "$OUT" && tar czf logs.tgz --remove-files *.log */base-gpu.json && cd - > /dev/null
cat "$OUT/machine.txt"
for f in "$OUT"/*/base-gpu.md; do echo "== $f"; grep -v "^$" "$f" | tail -n +4; done
