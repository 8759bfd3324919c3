"""The training corpus: the Python standard library's sources, split by file, tokenized.

Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, sorted by relative path,
minus test directories and site-packages; a file is held out when the first 8 bytes of
sha256(relative path) fall in the lowest ``heldout_fraction`` of the range (a pure
function of the path), so no file is in both splits. A byte-level BPE is trained on the
train files only; ``<|endoftext|>`` (id 0) ends every file in the token stream.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from edge0.tiny import EOS_TOKEN_ID, train_tokenizer

# Directory names that are never part of the corpus (any path component).
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})

def stdlib_root() -> Path:
    """The Python standard library's source directory of this interpreter."""
    root = sysconfig.get_paths().get("stdlib")
    if not root or not Path(root).is_dir():
        raise FileNotFoundError(f"the standard library directory {root!r} does not exist")
    return Path(root)


def list_corpus_files(root: Path | None = None) -> list[str]:
    """Sorted relative (POSIX) paths of the corpus's ``*.py`` files under ``root``."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            if name.endswith(".py"):
                out.append((rel_dir / name).as_posix())
    return sorted(out)


def is_heldout(rel_path: str, heldout_fraction: float) -> bool:
    """Whether the file ``rel_path`` belongs to the held-out split (a pure function of
    the path: stable across machines, runs and file contents)."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < heldout_fraction * 2**64


def split_files(files: Sequence[str], heldout_fraction: float) -> tuple[list[str], list[str]]:
    """(train, held-out) relative paths, each sorted; every file is in exactly one."""
    train, heldout = [], []
    for rel in sorted(files):
        (heldout if is_heldout(rel, heldout_fraction) else train).append(rel)
    return train, heldout


def _read_texts(root: Path, files: Iterable[str]) -> tuple[list[str], list[str], list[str]]:
    """(paths read, their texts, paths skipped as not UTF-8)."""
    kept, texts, skipped = [], [], []
    for rel in files:
        try:
            texts.append((root / rel).read_text(encoding="utf-8"))
            kept.append(rel)
        except UnicodeDecodeError:
            skipped.append(rel)
    return kept, texts, skipped


def _encode(tokenizer, texts: Sequence[str]) -> np.ndarray:
    """One uint16 stream: each text's ids followed by EOS."""
    parts = []
    for enc in tokenizer.encode_batch(list(texts)):
        ids = np.asarray(enc.ids, dtype=np.uint16)
        parts.append(ids)
        parts.append(np.array([EOS_TOKEN_ID], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sha256_lines(lines: Sequence[str]) -> str:
    return _sha256_bytes("".join(line + "\n" for line in lines).encode("utf-8"))


def _sha256_tokens(tokens: np.ndarray) -> str:
    return _sha256_bytes(np.ascontiguousarray(tokens, dtype="<u2").tobytes())


@dataclass
class Corpus:
    """The tokenized corpus: train / held-out streams, the tokenizer and provenance."""

    root: str
    train_files: list[str]
    heldout_files: list[str]
    skipped_files: list[str]
    tokenizer_json: str
    train_tokens: np.ndarray  # uint16
    heldout_tokens: np.ndarray  # uint16
    vocab_size: int

    def unigram_counts(self) -> np.ndarray:
        """Train-set token counts (int64, length ``vocab_size``)."""
        return np.bincount(self.train_tokens.astype(np.int64), minlength=self.vocab_size)

    def description(self) -> dict:
        return {
            "source": "Python standard library *.py files (sysconfig stdlib), sorted by relative path",
            "excluded_dirs": sorted(EXCLUDED_DIRS),
            "split": "by file: held out when int(sha256(relative path)[:8 bytes]) < fraction * 2**64",
            # no machine path in what ships: the default root is named by its Python version
            "stdlib_root": (f"<python {platform.python_version()} stdlib>"
                            if Path(self.root) == stdlib_root() else f"<{Path(self.root).name}>"),
            "python_version": platform.python_version(),
            "train_files": len(self.train_files),
            "heldout_files": len(self.heldout_files),
            "skipped_not_utf8": self.skipped_files,
            "train_file_list_sha256": _sha256_lines(self.train_files),
            "heldout_file_list_sha256": _sha256_lines(self.heldout_files),
            "train_tokens": int(self.train_tokens.size),
            "heldout_tokens": int(self.heldout_tokens.size),
            "train_token_stream_sha256": _sha256_tokens(self.train_tokens),
            "heldout_token_stream_sha256": _sha256_tokens(self.heldout_tokens),
            "tokenizer": "byte-level BPE (tokenizers) trained on the train files; EOS <|endoftext|> = 0 ends each file",
            "tokenizer_vocab_size": self.vocab_size,
            "tokenizer_json_sha256": _sha256_bytes(self.tokenizer_json.encode("utf-8")),
        }


def build_corpus(heldout_fraction: float, vocab_size: int, *, root: Path | None = None,
                 files: Sequence[str] | None = None) -> Corpus:
    """Read, split, train the tokenizer on the train split and tokenize both splits.

    ``files`` (relative paths under ``root``) restricts the corpus, e.g. for tests;
    by default every file of :func:`list_corpus_files`.
    """
    root = Path(root) if root is not None else stdlib_root()
    files = list_corpus_files(root) if files is None else sorted(files)
    if not files:
        raise ValueError(f"no corpus files found under {root}")
    train_rel, heldout_rel = split_files(files, heldout_fraction)
    if not train_rel or not heldout_rel:
        raise ValueError(f"the split of {len(files)} files left an empty side "
                         f"(train {len(train_rel)}, held-out {len(heldout_rel)}); "
                         "use more files or another heldout_fraction")
    train_rel, train_texts, skipped_t = _read_texts(root, train_rel)
    heldout_rel, heldout_texts, skipped_h = _read_texts(root, heldout_rel)
    tokenizer = train_tokenizer(train_texts, vocab_size)
    return Corpus(
        root=str(root),
        train_files=train_rel,
        heldout_files=heldout_rel,
        skipped_files=sorted(skipped_t + skipped_h),
        tokenizer_json=tokenizer.to_str(),
        train_tokens=_encode(tokenizer, train_texts),
        heldout_tokens=_encode(tokenizer, heldout_texts),
        vocab_size=vocab_size,
    )
