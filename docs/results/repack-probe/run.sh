#!/bin/sh
# A repacked layout measured before building it: a layer's k experts read as stored (a range
# per stacked tensor) against one range per expert, direct reads, 2 threads, 400 draws each.
set -e
cd "$(dirname "$0")/../../.."  # the repository
MODEL=${MODEL:-$HOME/.cache/edge0/bench-35b-40L}  # edge0 bench --layers 40 writes it
for k in 8 10; do
  for seed in 1 2 3; do
    python tools/repack_probe.py --model "$MODEL" --draws 400 --k $k --seed $seed \
      --json docs/results/repack-probe/k$k-seed$seed.json
  done
done
