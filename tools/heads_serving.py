"""Show or set the routing a prerouter heads file recommends (its ``serving`` record), the
engine's choice when its ``routing`` is "auto". Every tensor byte and every other field
stay as they were, and adapters trained under the heads still load: their identity leaves
this record out, and an adapter beside the checkpoint that recorded the heads' whole header
(adapters made before) is re-recorded with that identity.

    python tools/heads_serving.py HEADS                      # print the record
    python tools/heads_serving.py HEADS --routing select:2 [--over-memory select:0]

``--routing``: where the checkpoint fits in the memory the process may use (and wherever no
``--over-memory`` is recorded); ``--over-memory``: where the checkpoint's files are larger
than that memory. Each is ``replace`` or ``select:M`` (M experts staged beyond k).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from edge0.adapters import ADAPTER_DIRNAME, WEIGHTS_FILE
from edge0.errors import Edge0Error
from edge0.model.safetensors_header import read_header
from edge0.prerouter.files import parse_routing, serving_of, set_serving


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("heads", help="the heads file (prerouter.safetensors)")
    p.add_argument("--routing", default=None, help="'replace' or 'select:M'")
    p.add_argument("--over-memory", default=None, help="'replace' or 'select:M'; 'none' drops it")
    args = p.parse_args(argv)
    try:
        record = serving_of(read_header(args.heads).metadata, args.heads)
        if args.routing is None and args.over_memory is None:
            print(json.dumps(record, sort_keys=True))
            return 0
        if args.routing is not None:
            record = {**parse_routing(args.routing), **({"over_memory": record["over_memory"]}
                                                         if "over_memory" in record else {})}
        if args.over_memory == "none":
            record.pop("over_memory", None)
        elif args.over_memory is not None:
            record["over_memory"] = parse_routing(args.over_memory)
        beside = Path(args.heads).parent / ADAPTER_DIRNAME / WEIGHTS_FILE
        stale = set_serving(args.heads, record, [beside] if beside.is_file() else [])
    except Edge0Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(record, sort_keys=True))
    for weights in stale:
        print(f"re-recorded the heads' identity in {weights}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
