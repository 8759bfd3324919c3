#!/bin/sh
# The speed forecast at the first read's rate under the 8 GiB cap, llama.cpp beside
# (docs/BENCHMARKS.md, "the speed forecast at the first read's rate"). Root (the memory
# cgroup of the cap); the speed cache emptied first, so the forecast measures its drive,
# kernels and replica in the same run. About 14 minutes here.
set -e
out=${1:-docs/results/speed-forecast/40L-8G-first-read}
rm -f "${EDGE0_CACHE:-$HOME/.cache/edge0}"/speed/*.json
echo 128 > /sys/block/"${DISK:-vda}"/queue/read_ahead_kb
edge0 bench --layers 40 --arms staged+prerouter,exact,llama.cpp --forecast --rounds 3 --cache cold --memory-limit 8G \
  --prompt-tokens 32 --decode-tokens 64 --no-chart --out "$out"
