#!/bin/bash
# corpus-KL phase 2: targets once on both cores, then replace (core 0) and select (core 1)
# run from the repository root
SERIAL=/usr/lib/x86_64-linux-gnu/openblas-serial/libopenblas.so.0
V=~/.cache/edge0/adapter-v3; P=$V/progress
echo "$(date +%T) targets start" >> $P
.venv/bin/python - <<'PY' > $V/targets.log 2>&1
from pathlib import Path
from edge0.train.sft import SFTConfig, corpus_targets
import os
w = Path(os.path.expanduser("~/.cache/edge0/adapter-v3/targets"))
w.mkdir(parents=True, exist_ok=True)
corpus_targets(Path("teachers/demo-v2"), Path("edge0/data/demo_model"), SFTConfig(text="corpus"), w)
PY
echo "$(date +%T) targets done rc $?" >> $P
export OMP_NUM_THREADS=1 LD_PRELOAD=$SERIAL
for r in replace select; do
  mkdir -p $V/$r; cp $V/targets/corpus_rows-* $V/$r/
done
run() {
  local r=$1 c=$2; local W=$V/$r
  taskset -c $c .venv/bin/edge0 train sft --model edge0/data/demo_model --teacher teachers/demo-v2 --text corpus --routing $r --work $W --no-progress --resume --out $W/adapter > $W/sft.log 2>&1
  echo "$(date +%T) $r sft done rc $?" >> $P
  taskset -c $c .venv/bin/edge0 train quality --model edge0/data/demo_model --teacher teachers/demo-v2 --row "$r + corpus-KL adapter:routing=$r,adapter=$W/adapter" --json $W/quality.json > $W/quality.md 2> $W/quality.log
  echo "$(date +%T) $r quality done rc $?" >> $P
}
run replace 0 &
run select 1 &
wait
