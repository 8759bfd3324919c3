#!/bin/sh
# The speed forecast beside the bench (docs/BENCHMARKS.md, "the speed forecast beside the bench"):
# each Edge0 arm's `edge0 plan --speed` forecast, made before it runs, beside what it measured.
# Root (the memory cgroup of the cap). The speed cache is emptied first, so every forecast
# measures its drive, kernels and replica in the same run.
set -e
out=${1:-docs/results/speed-forecast}
rm -f "${EDGE0_CACHE:-$HOME/.cache/edge0}"/speed/*.json
echo 128 > /sys/block/"${DISK:-vda}"/queue/read_ahead_kb
edge0 bench --layers 12 --arms exact,staged+prerouter,resident@edge0 --arm-option resident@edge0:kernels=edge0 \
  --forecast --rounds 3 --cache warm --prompt-tokens 256 --decode-tokens 32 --no-chart --out "$out/12L"
rm -f "${EDGE0_CACHE:-$HOME/.cache/edge0}"/speed/*.json
edge0 bench --layers 40 --arms staged+prerouter,exact --forecast --rounds 3 --cache cold --memory-limit 8G \
  --prompt-tokens 32 --decode-tokens 16 --no-chart --out "$out/40L-8G"
