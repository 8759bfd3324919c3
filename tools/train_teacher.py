#!/usr/bin/env python
"""Train the teacher MoE: the same as ``edge0 train teacher`` (see docs/TEACHER.md)."""

import sys

from edge0.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", "teacher", *sys.argv[1:]]))
