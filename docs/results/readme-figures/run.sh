#!/bin/sh
# The README's table of figures, on one machine in one sitting (root: a memory cgroup per arm
# under the cap, the page cache dropped before each cold run, the device's readahead at 128 KiB
# for every arm, llama.cpp as its best user runs it): the 35B-shaped checkpoint at 40 layers
# under an 8 GiB cap, then at 12 layers in memory. Each results file names the machine.
# llama.cpp: pip install 'edge0[llamacpp]' first (about 20 minutes; the GGUF copies are
# converted once, into Edge0's cache).
set -e
OUT=docs/results/readme-figures
DEV=${DEV:-vda}
old=$(cat /sys/block/$DEV/queue/read_ahead_kb)
echo 128 > /sys/block/$DEV/queue/read_ahead_kb
trap 'echo $old > /sys/block/'$DEV'/queue/read_ahead_kb' EXIT
edge0 bench --layers 40 --arms staged+prerouter,llama.cpp --memory-limit 8G --cache cold --rounds 3 \
  --llama-threads 2 --no-chart --no-progress --out $OUT/40L-8G
edge0 bench --layers 12 --arms resident,staged+prerouter,llama.cpp --cache warm --rounds 3 \
  --llama-threads 2 --no-chart --no-progress --out $OUT/12L
