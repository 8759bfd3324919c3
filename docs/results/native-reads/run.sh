#!/bin/sh
# A layer's reads in one call, and the automatic budget in the staged slots (docs/BENCHMARKS.md,
# "Results: a layer's reads in one call, the cache's memory in the slots"): the staged arm of
# this tree, of this tree with the plan's slots as before (slots_per_layer=16: 2k slots beside
# the automatic cache) and of the tree before both (commit 0aa0345, its kernels built here:
# cmake, a C++ compiler and nanobind, `pip install 'nanobind>=3.0,<3.2'`), and the exact arm,
# 40 layers under the 8 GiB cap, in one run; then what the reads cost the CPU alone
# (tools/read_cost.py).
# Root (the memory cgroup of the cap). Usage: run.sh [OUT]
set -e
out=${1:-docs/results/native-reads}
before=$(mktemp -d)
git archive 0aa0345 src | tar -x -C "$before"
cmake -S "$before/src/edge0/backend/mlx/kernels/csrc" -B "$before/build" -DPython_EXECUTABLE="$(command -v python)" \
  -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build "$before/build" -j 2 > /dev/null
cp "$before"/build/_ext*.so "$before/src/edge0/backend/mlx/kernels/"
echo 128 > /sys/block/"${DISK:-vda}"/queue/read_ahead_kb
edge0 bench --layers 40 --arms "staged+prerouter,staged+prerouter@cache,staged+prerouter@before,exact" \
  --arm-option "staged+prerouter@cache:slots_per_layer=16" \
  --arm-option "staged+prerouter@before:source=$before" --rounds 3 --cache cold --memory-limit 8G \
  --prompt-tokens 32 --decode-tokens 48 --no-chart --out "$out/40L-8G"
python tools/read_cost.py --gb 1 --repeats 3 --modes direct,buffered --memory-limit 8G --paths python,extension \
  --calls expert --json "$out/read_cost.json" > "$out/read_cost.md"
rm -rf "$before"
