#!/bin/sh
# Where the cores' time goes during decode, 40 layers under the 8 GiB cap (docs/BENCHMARKS.md,
# "Results: the speed forecast with the reads' slowdown..."): each arm alone, 128 decode tokens,
# `perf record` of the whole machine for 12 s in the middle of its decode, then the samples by
# program and library. Root (the cap and perf). Usage: run.sh [ARM...] (default both arms).
set -e
out=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
echo 128 > /sys/block/"${DISK:-vda}"/queue/read_ahead_kb
for arm in ${*:-staged+prerouter exact}; do
  edge0 bench --layers 40 --arms "$arm" --rounds 1 --cache cold --memory-limit 8G --prompt-tokens 32 \
    --decode-tokens 128 --no-chart --no-progress --out "$work/$arm" > "$work/$arm.log" 2>&1 &
  until grep -q "round 1/1" "$work/$arm.log"; do sleep 2; done
  sleep 28  # the arm loads (about 8 s) and prefills (about 5 s); its decode runs about 40 s
  perf record -a -g -o "$work/$arm.data" -- sleep 12 > /dev/null 2>&1
  wait
  { grep "^| $arm " "$work/$arm/bench.md"
    perf report -i "$work/$arm.data" --no-children --sort comm,dso --stdio -g none 2>/dev/null | grep -v "^#" | grep -v "^$" | head -12
  } > "$out/$arm.txt"
done
rm -rf "$work"
