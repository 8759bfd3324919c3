#!/bin/bash
# corpus-KL phase 2 on 8,192 windows: the teacher scores the 4,096 new ones on both cores,
# then select m=2 (1,200 steps, core 1) and replace (600 steps, core 0), one core each.
cd "$(dirname "$0")/../../.."  # the repository
SERIAL=/usr/lib/x86_64-linux-gnu/openblas-serial/libopenblas.so.0
V=${V:-$HOME/.cache/edge0/adapter-v4}; export V; P=$V/progress
echo "$(date +%T) targets start" >> $P
.venv/bin/python - <<'PY' > $V/targets.log 2>&1
from pathlib import Path
from edge0.train.sft import SFTConfig, corpus_targets
import os
w = Path(os.environ.get("V", os.path.expanduser("~/.cache/edge0/adapter-v4"))) / "targets"
corpus_targets(Path("teachers/demo-v2"), Path("edge0/data/demo_model"), SFTConfig(text="corpus", rows=8192), w)
PY
echo "$(date +%T) targets done rc $?" >> $P
export OMP_NUM_THREADS=1 LD_PRELOAD=$SERIAL
for r in replace select; do mkdir -p $V/$r; cp $V/targets/corpus_* $V/$r/; done
run() {
  local r=$1 c=$2 steps=$3; local W=$V/$r
  taskset -c $c .venv/bin/edge0 train sft --model edge0/data/demo_model --teacher teachers/demo-v2 --text corpus --rows 8192 --steps $steps --routing $r --work $W --no-progress --resume --out $W/adapter > $W/sft.log 2>&1
  echo "$(date +%T) $r sft done rc $?" >> $P
  taskset -c $c .venv/bin/edge0 train quality --model edge0/data/demo_model --teacher teachers/demo-v2 --row "$r + corpus-KL adapter, 8192 windows, $steps steps:routing=$r,adapter=$W/adapter" --json $W/quality.json > $W/quality.md 2> $W/quality.log
  echo "$(date +%T) $r quality done rc $?" >> $P
}
run replace 0 600 &
run select 1 1200 &
wait
