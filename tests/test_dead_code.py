"""No dead code: vulture over the package, its tools and its tests finds no name that is
never used, but the ones ``tests/vulture_whitelist.py`` lists with their reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_name_is_defined_and_never_used():
    r = subprocess.run([sys.executable, "-m", "vulture", "src/edge0", "tools", "tests", "tests/vulture_whitelist.py",
                        "--min-confidence", "60", "--ignore-decorators", "@arm",  # bench arms: registered by name
                        "--ignore-names", "__class__,__cause__"],  # assigned for the interpreter to read
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout, "unused code:\n" + r.stdout + r.stderr
