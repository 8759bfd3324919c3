#!/usr/bin/env python
"""Held-out quality of a checkpoint, optionally against its teacher: `edge0 eval`.

    python tools/eval_model.py --model DIR [--teacher DIR] --data HELDOUT [...]
"""

import sys

from edge0.train.eval_cli import main

if __name__ == "__main__":
    sys.exit(main())
