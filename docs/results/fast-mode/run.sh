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
