"""Where Edge0 keeps what it builds once: ``$EDGE0_CACHE``, else ``$XDG_CACHE_HOME/edge0``,
else ``~/.cache/edge0``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("EDGE0_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "edge0")
    return Path(root)
