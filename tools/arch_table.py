"""Rewrite the table in docs/MODELS.md of supported architectures from the code.

    python tools/arch_table.py          # rewrite docs/MODELS.md in place
    python tools/arch_table.py --check  # exit 1 when docs/MODELS.md is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BEGIN, END = "<!-- architectures:begin -->", "<!-- architectures:end -->"


def rendered(readme: str, table: str) -> str:
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main() -> int:
    from edge0.tiny.table import architecture_table

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only check; exit 1 when docs/MODELS.md differs")
    args = p.parse_args()
    path = ROOT / "docs" / "MODELS.md"
    text = path.read_text()
    new = rendered(text, architecture_table())
    if args.check:
        return 0 if new == text else 1
    path.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
