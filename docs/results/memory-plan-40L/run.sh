#!/bin/sh
# The memory plan's automatic expert cache on the 40-layer 35B-shaped checkpoint under memory
# caps (root: a memory cgroup per arm), against the same arm with the cache off and llama.cpp
# as its best user runs it (the device's readahead at 128 KiB), page cache dropped before
# each run; then `edge0 plan`'s forecast of each cap from the replay's recorded routing.
set -e
OUT=docs/results/memory-plan-40L
MODEL=${MODEL:-$HOME/.cache/edge0/bench-35b-40L}
DEV=${DEV:-vda}
old=$(cat /sys/block/$DEV/queue/read_ahead_kb)
echo 128 > /sys/block/$DEV/queue/read_ahead_kb
trap 'echo $old > /sys/block/'$DEV'/queue/read_ahead_kb' EXIT
for cap in 8G 6G 4G; do
  edge0 bench --layers 40 --arms staged+prerouter,staged+prerouter@nocache,llama.cpp \
    --arm-option staged+prerouter@nocache:cache_mb=0 --memory-limit $cap --cache cold --rounds 3 \
    --llama-threads 2 --no-chart --out $OUT/$cap
done

# The forecast column: the exact path's routing over the bench's replay sequence (its prompt
# included) and the bench's warm-start heads, then `edge0 plan` for each cap.
python - "$MODEL" "$OUT" <<'PY'
import sys
from pathlib import Path
from edge0.benchmark.arms import record_oracle
from edge0.benchmark.harness import make_replay
from edge0.train.heads import make_warm_heads
model, out = Path(sys.argv[1]), Path(sys.argv[2])
replay = make_replay(model, 32, 16)
record_oracle(str(model), replay["prompt"], replay["continuation"], str(out / "routing-trace.json"))
make_warm_heads(model, out / "warm-heads.safetensors")
PY
for cap in 8G 6G 4G; do
  edge0 plan --model "$MODEL" --memory $cap --trace $OUT/routing-trace.json \
    --prerouter-file $OUT/warm-heads.safetensors --json > $OUT/plan-$cap.json
done
rm $OUT/warm-heads.safetensors
sed -i "s#$MODEL#$(basename "$MODEL")#g" $OUT/plan-*.json $OUT/routing-trace.json  # the checkpoint by its name
