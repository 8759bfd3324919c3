#!/bin/sh
# The expert cache on the 40-layer 35B-shaped checkpoint under memory caps (root: a memory
# cgroup per arm), against the same arm with the cache off, page cache dropped before each run.
set -e
for cap in 8G 6G 4G; do
  edge0 bench --layers 40 --arms staged+prerouter,staged+prerouter@nocache \
    --arm-option staged+prerouter@nocache:cache_mb=0 --memory-limit $cap --cache cold --rounds 3 \
    --no-chart --out docs/results/expert-cache-40L/$cap
done
