#!/bin/bash
# run from the repository root
export OMP_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-serial/libopenblas.so.0
V=~/.cache/edge0/adapter-v3; W=$V/select-r16; P=$V/progress
taskset -c 1 .venv/bin/edge0 train sft --model edge0/data/demo_model --teacher teachers/demo-v2 --text corpus --routing select --rank 16 --work $W --no-progress --resume --out $W/adapter > $W/sft.log 2>&1
echo "$(date +%T) select-r16 sft done rc $?" >> $P
taskset -c 1 .venv/bin/edge0 train quality --model edge0/data/demo_model --teacher teachers/demo-v2 --row "select + corpus-KL adapter rank 16:routing=select,adapter=$W/adapter" --json $W/quality.json > $W/quality.md 2> $W/quality.log
echo "$(date +%T) select-r16 quality done rc $?" >> $P
