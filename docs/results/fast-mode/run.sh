#!/bin/bash
# The fast mode (select with m = 0: the predicted k read, weighed by the layer's own router)
# and select m = 4 beside the shipped routings, with and without the shipped adapter.
# Run from the repository root; one core each (about 10 minutes each here).
set -e
A=edge0/data/demo_model/adapter
rows=(--row "select m=0:routing=select,stage_extra=0,adapter=off"
      --row "select m=0 + shipped adapter:routing=select,stage_extra=0,adapter=$A"
      --row "select m=4 + shipped adapter:routing=select,stage_extra=4,adapter=$A")
OUT=docs/results/fast-mode
edge0 train quality --model edge0/data/demo_model --teacher teachers/demo-v2 "${rows[@]}" \
    --row "select m=1:routing=select,stage_extra=1,adapter=off" --json $OUT/quality-heldout.json > $OUT/quality-heldout.md
# Python code outside the standard library: this repository's tools/ at commit 487e2db
T=$(mktemp -d); git archive 487e2db tools | tar -x -C $T
edge0 train quality --model edge0/data/demo_model --teacher teachers/demo-v2 --text $T/tools \
    --row "select m=2:routing=select,stage_extra=2,adapter=off" \
    --row "select m=2 + shipped adapter:routing=select,stage_extra=2,adapter=$A" "${rows[@]}" \
    --row "replace:routing=replace,adapter=off" --json $OUT/quality-outside-stdlib-tools.json > $OUT/quality-outside-stdlib-tools.md
# Speed: replace against select m=0 and more candidates (one core each, beside a training)
edge0 bench --layers 40 --arms staged+prerouter,staged+prerouter@sel0,staged+prerouter@sel2 \
    --arm-option staged+prerouter:routing=replace --arm-option staged+prerouter@sel0:routing=select,stage_extra=0 \
    --arm-option staged+prerouter@sel2:routing=select,stage_extra=2 \
    --rounds 3 --cache cold --memory-limit 8G --decode-tokens 32 --out $OUT/bench-35b-40L-8G
edge0 bench --layers 12 --arms staged+prerouter,staged+prerouter@sel0,staged+prerouter@sel4,staged+prerouter@sel8 \
    --arm-option staged+prerouter:routing=replace --arm-option staged+prerouter@sel0:routing=select,stage_extra=0 \
    --arm-option staged+prerouter@sel4:routing=select,stage_extra=4 --arm-option staged+prerouter@sel8:routing=select,stage_extra=8 \
    --rounds 5 --cache warm --decode-tokens 32 --out $OUT/bench-35b-12L-warm
D=edge0/data/demo_model
edge0 bench --model $D --heads $D/prerouter.safetensors --adapter $D/adapter \
    --arms staged+prerouter,staged+prerouter@sel0,staged+prerouter@sel4 \
    --arm-option staged+prerouter:routing=select,stage_extra=2 --arm-option staged+prerouter@sel0:routing=select,stage_extra=0 \
    --arm-option staged+prerouter@sel4:routing=select,stage_extra=4 --rounds 7 --cache warm --decode-tokens 128 --out $OUT/bench-demo
# Tried: the shipped recipe trained on select m=4 instead of m=2 (600 steps, one core, 89 minutes with
# serial OpenBLAS: LD_PRELOAD=.../openblas-serial/libopenblas.so.0 OMP_NUM_THREADS=1), then its rows
W=${W:-$HOME/.cache/edge0/adapter-m4}
edge0 train sft --model $D --teacher teachers/demo-v2 --text corpus --routing select --stage-extra 4 \
    --work $W --no-progress --resume --out $W/adapter > $OUT/sft-select-m4.log
edge0 train quality --model $D --teacher teachers/demo-v2 \
    --row "select m=4 + m=4 adapter:routing=select,stage_extra=4,adapter=$W/adapter" \
    --row "select m=2 + m=4 adapter:routing=select,stage_extra=2,adapter=$W/adapter" \
    --row "select m=0 + m=4 adapter:routing=select,stage_extra=0,adapter=$W/adapter" \
    --json $OUT/quality-m4-adapter-heldout.json > $OUT/quality-m4-adapter-heldout.md
edge0 train quality --model $D --teacher teachers/demo-v2 --text $T/tools \
    --row "select m=4 + m=4 adapter:routing=select,stage_extra=4,adapter=$W/adapter" \
    --row "select m=0 + m=4 adapter:routing=select,stage_extra=0,adapter=$W/adapter" \
    --json $OUT/quality-m4-adapter-outside-stdlib-tools.json > $OUT/quality-m4-adapter-outside-stdlib-tools.md
