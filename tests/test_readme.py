"""The README's statements that the code can check: the architecture table and its count."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from edge0.model.families import SUPPORTED_MODEL_TYPES
from edge0.tiny.table import architecture_table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


def test_architecture_table_is_generated_from_the_code():
    from arch_table import rendered

    text = (ROOT / "README.md").read_text()
    assert rendered(text, architecture_table()) == text, "README table out of date: python tools/arch_table.py"


def test_stated_count_is_the_tested_list():
    text = (ROOT / "README.md").read_text()
    counts = {int(n) for n in re.findall(r"(\d+) model types", text)}
    assert counts == {len(SUPPORTED_MODEL_TYPES)}, counts
    rows = re.findall(r"^\| `([^`]+)` \| `", text, flags=re.M)
    assert tuple(rows) == SUPPORTED_MODEL_TYPES
