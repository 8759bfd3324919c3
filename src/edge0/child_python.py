"""Command lines for child Python processes that import the same Edge0 as this process,
whatever the working directory.

``python -m MODULE`` and ``python -c CODE`` put the working directory first on the child's
``sys.path``. Run from the folder a clone of Edge0 sits in (so the working directory holds
the clone's folder, named ``edge0``), such a child imported that folder as a namespace
package ``edge0``: an editable install (``pip install -e .``) is found by an import hook
that runs only after the whole path has been searched, and a namespace package found on
the path comes first. The child then failed (``cannot import name 'Engine' from 'edge0'
(unknown location)``). These children run with ``-P`` (no working directory on their
path) and with the folder this process's Edge0 was imported from appended to their path:
a regular package there is found before any namespace package.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)  # the folder holding this process's edge0/
_RUN_MODULE = ("import runpy, sys; sys.path.append(sys.argv.pop(1)); "
               "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")


def python_module(module: str, *args: str) -> list[str]:
    """``python -m module args`` in a child that imports this process's Edge0."""
    return [sys.executable, "-P", "-c", _RUN_MODULE, _ROOT, module, *args]


def python_code(code: str, *args: str) -> list[str]:
    """``python -c code args`` in a child that imports this process's Edge0."""
    return [sys.executable, "-P", "-c", f"import sys; sys.path.append({_ROOT!r})\n{code}", *args]
