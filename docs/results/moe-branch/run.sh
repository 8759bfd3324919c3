#!/bin/bash
# Trial: an MLP beside each predicted layer's MoE block, trained as the shipped adapter is
# (forward KL to the teacher's top 32 on 4,096 windows of the training split), one routing
# per core; held-out perplexity on the student path over the 4,080 positions of QUALITY.md.
cd "$(dirname "$0")/../../.."  # the repository
SERIAL=/usr/lib/x86_64-linux-gnu/openblas-serial/libopenblas.so.0  # apt-get install libopenblas0-serial
W=${W:-$HOME/.cache/edge0/moe-branch}; export W; mkdir -p $W
export OMP_NUM_THREADS=1 LD_PRELOAD=$SERIAL
# the teacher scores the windows once (cached in $W; about 55 minutes of one core here)
taskset -c 1 .venv/bin/python - <<'PY'
import os
from pathlib import Path
from edge0.train.sft import SFTConfig, corpus_targets
corpus_targets(Path("teachers/demo-v2"), Path("edge0/data/demo_model"), SFTConfig(text="corpus"), Path(os.environ["W"]))
PY
run() {
  taskset -c $2 .venv/bin/python tools/moe_branch_trial.py --teacher teachers/demo-v2 --work $W --routing $1 \
    --width 64 --steps 300 --json docs/results/moe-branch/$1-64.json > $W/$1.log 2>&1
}
run replace 1 &
run select 0 &
wait
