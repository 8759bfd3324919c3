#!/bin/sh
# The decode loop's restructuring against the code before it (a63af98), one bench run each:
# the 12-layer 35B-shaped checkpoint and the demo, staged+prerouter, the page cache warm.
set -e
git worktree add ../edge0-before a63af98
cp edge0/backend/mlx/kernels/_ext*.so ../edge0-before/edge0/backend/mlx/kernels/  # same kernels' source
edge0 bench --layers 12 --arms staged+prerouter,staged+prerouter@old \
  --arm-option staged+prerouter@old:source=../edge0-before --cache warm --rounds 7 --decode-tokens 48 \
  --no-chart --out docs/results/decode-loop-ab/12L
edge0 bench --model edge0/data/demo_model --arms staged+prerouter,staged+prerouter@old \
  --arm-option staged+prerouter@old:source=../edge0-before --heads edge0/data/demo_model/prerouter.safetensors \
  --adapter edge0/data/demo_model/adapter --cache warm --rounds 9 --decode-tokens 96 \
  --no-chart --out docs/results/decode-loop-ab/demo
