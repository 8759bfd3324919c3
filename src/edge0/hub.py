"""Model names as mlx-lm takes them: a local directory, or a Hugging Face repo id resolved
from the local hub cache without touching the network.

``resolve_model("mlx-community/Qwen3-30B-A3B-4bit")`` returns the cached snapshot
directory (``$HF_HUB_CACHE`` or ``$HF_HOME/hub``, as huggingface_hub finds it). A repo that
is not cached is a ``ConfigError`` saying how to get it: download it, or convert an
unquantized model with ``mlx_lm.convert -q``. Edge0 never downloads anything itself.
"""

from __future__ import annotations

import re
from pathlib import Path

from edge0.errors import ConfigError

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# what mlx-lm fetches for a model (its DEFAULT_ALLOW_PATTERNS)
_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt",
             "*.jsonl", "*.jinja"]


_QUANTIZED = re.compile(r"(?i)[-_](int)?[2-8]-?bits?\b|[-_](q|int)[2-8]\b|mlx-community/")


def resolve_model(name: str | Path) -> Path:
    """The local directory of ``name``: itself when it exists, else its hub-cache snapshot."""
    path = Path(name)
    if path.exists():
        return path
    text = str(name)
    if not _REPO_ID.match(text):
        raise ConfigError(f"{text} is not a model directory (it does not exist) nor a Hugging Face repo id "
                          "(ORG/NAME)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - mlx-lm depends on it
        raise ConfigError(f"{text}: resolving a repo id needs huggingface_hub") from None
    try:
        return Path(snapshot_download(text, local_files_only=True, allow_patterns=_PATTERNS))
    except Exception:  # LocalEntryNotFoundError, incomplete snapshots, a cache that does not exist
        get = f"Get it with `hf download {text}` (needs network)"
        if not _QUANTIZED.search(text):  # a name that does not say it is quantized may be the unquantized model
            get += (f" if it is an int4 MLX checkpoint, or convert an unquantized model: `mlx_lm.convert --hf-path "
                    f"{text} -q --q-bits 4 --q-group-size 64 --mlx-path DIR`")
        raise ConfigError(f"{text} is not in the local Hugging Face cache ({_cache_dir()}). {get}") from None


def repo_id_of(path: str | Path) -> str | None:
    """The hub repo id a local directory is a snapshot of (``.../models--ORG--NAME/snapshots/REV``),
    or None."""
    parts = Path(path).resolve().parts
    for part, after in zip(parts, parts[1:]):
        if part.startswith("models--") and after == "snapshots" and part.count("--") >= 2:
            org, _, name = part[len("models--"):].partition("--")
            return f"{org}/{name}"
    return None


def _cache_dir() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except Exception:  # pragma: no cover
        return "the Hugging Face hub cache"
