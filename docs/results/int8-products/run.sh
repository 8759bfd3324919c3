#!/bin/sh
# Integer products (int8_products) against the float32 loops, 12 layers of the 35B-shaped
# checkpoint in memory, page cache warm, with llama.cpp built for this CPU
# (pip install 'edge0[llamacpp]'); then the kernels alone in C++ and the demo's perplexity.
set -e
OUT=${OUT:-docs/results/int8-products/12L}
edge0 bench --layers 12 \
  --arms resident@edge0,resident@edge0@int8,exact,exact@int8,staged+prerouter,staged+prerouter@int8,llama.cpp \
  --arm-option resident@edge0:kernels=edge0 --arm-option resident@edge0@int8:kernels=edge0,int8_products=on \
  --arm-option exact@int8:int8_products=on --arm-option staged+prerouter@int8:int8_products=on \
  --cache warm --rounds 3 --prompt-tokens 32 --decode-tokens 32 --llama-threads 2 --no-chart --no-progress --out $OUT
g++ -O2 -std=c++17 -I src/edge0/backend/mlx/kernels/csrc tools/qmm_bench.cpp \
  src/edge0/backend/mlx/kernels/csrc/qmm.cpp -o /tmp/qmm_bench -lpthread
for run in 1 2 3; do for t in 1 2; do
  for shape in "--n 512 --k 2048" "--n 2048 --k 512" "--n 2048 --k 2048 --topk 1"; do for q in 0 1; do
    /tmp/qmm_bench $shape --rows 1 --threads $t --calls 400 --int8 $q
  done; done
done; done > docs/results/int8-products/qmm_bench.txt
python tools/int8_quality.py --model src/edge0/data/demo_model --data src/edge0/cli.py \
  > docs/results/int8-products/quality.txt
