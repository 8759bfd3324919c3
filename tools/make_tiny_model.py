#!/usr/bin/env python
"""Build a small random int4 MoE checkpoint that mlx_lm.load accepts.

    python tools/make_tiny_model.py FAMILY OUT [--layers N] [--experts N] [--k N]
        [--hidden N] [--moe-intermediate N] [--seed N] [--dtype D] [--overwrite]

The same as `edge0 make-tiny`; see `edge0 make-tiny --help`.
"""

import sys

from edge0.cli import main

if __name__ == "__main__":
    sys.exit(main(["make-tiny", *sys.argv[1:]]))
