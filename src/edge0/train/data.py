"""Training data for the recovery LoRA: prompts from the training split, continuations
written by a model (the float32 teacher for phase 2, the served student for phase 3).

- ``corpus_tokens(model_dir)``: the train and held-out token streams the model was trained
  on, rebuilt from its provenance (the corpus is deterministic) and checked against the
  hashes recorded there, so the adapter never trains on held-out text.
- ``token_streams(model_dir)``: those, or for a model without a provenance standard-library
  text in its own tokenizer; both built once and kept in Edge0's cache (``edge0.train.kept``).
- ``prompts(stream, n, length, seed)``: random windows of the train stream.
- ``sample(model, prompts, new_tokens, temp, seed)``: batched sampling with a KV cache,
  float32, seeded; rows run to the full length and ``continuation_mask`` drops everything
  after an end-of-text token from the losses.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from edge0.errors import ConfigError
from edge0.train import kept as K

EOS = 0


def corpus_tokens(model_dir: str | Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train tokens, held-out tokens, corpus description) of the model's training corpus:
    rebuilt once (a tokenizer trained on the corpus, every file encoded: seconds) and kept in
    Edge0's cache under its train stream's hash, which is checked again on every read."""
    from edge0.train.corpus import build_corpus

    prov_path = Path(model_dir) / "provenance.json"
    if not prov_path.exists():
        raise ConfigError(f"{model_dir} has no provenance.json: its training corpus is unknown (the recovery "
                          "recipe needs the teacher's train split; pass --data with a token file instead)")
    prov = json.loads(prov_path.read_text())
    corpus_desc, train_cfg = prov["corpus"], prov["train_config"]
    want = corpus_desc["train_token_stream_sha256"]
    got = K.kept("corpus", want)
    if got is not None and _sha256(got[0]) == want:
        return got
    corpus = build_corpus(train_cfg["heldout_fraction"], train_cfg["vocab_size"])
    if _sha256(corpus.train_tokens) != want:
        raise ConfigError(f"the corpus rebuilt here differs from the one {model_dir} was trained on (train "
                          "token stream hash mismatch: another Python standard library?)")
    desc = corpus.description()
    K.keep("corpus", want, corpus.train_tokens, corpus.heldout_tokens, desc)
    return corpus.train_tokens, corpus.heldout_tokens, desc


def _sha256(tokens: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype="<u2").tobytes()).hexdigest()


def token_streams(model_dir: str | Path) -> tuple[np.ndarray, np.ndarray, str]:
    """(train, held-out, description): the model's own training split when its provenance
    names one (the teacher's corpus), else Python standard-library sources split by file
    and tokenized with the model's tokenizer (tiny random models)."""
    if (Path(model_dir) / "provenance.json").exists():
        train, held, desc = corpus_tokens(model_dir)
        return train, held, f"the model's training corpus (train split {desc['train_token_stream_sha256'][:16]})"
    from edge0.backend import nn as bnn
    from edge0.train.heads import default_texts

    train_texts, held_texts, desc = default_texts()
    key = _texts_key(Path(model_dir), train_texts + held_texts, desc)
    got = K.kept("texts", key)
    if got is not None:  # (kept as int32: half the bytes)
        return got[0].astype(np.int64), got[1].astype(np.int64), desc
    tok = bnn.load_tokenizer(Path(model_dir))
    enc = lambda texts: np.array([t for text in texts for t in tok.encode(text)], dtype=np.int64)
    train, held = enc(train_texts), enc(held_texts)
    K.keep("texts", key, train.astype(np.int32), held.astype(np.int32), desc)
    return train, held, desc


TOKENIZER_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja", ".py")
TOKENIZER_PACKAGES = ("edge0", "mlx-lm", "transformers", "tokenizers", "sentencepiece", "tiktoken")


def _texts_key(model_dir: Path, texts: list[str], desc: str) -> str:
    """What the streams of ``texts`` in ``model_dir``'s tokenizer depend on: the texts, the
    folder's files a tokenizer is read from (its own, its config, a chat template) and the
    versions of the packages that read them."""
    from importlib.metadata import PackageNotFoundError, version

    h = hashlib.sha256(desc.encode())
    for package in TOKENIZER_PACKAGES:
        try:
            h.update(f"{package} {version(package)}\0".encode())
        except PackageNotFoundError:
            h.update(f"{package} absent\0".encode())
    for text in texts:
        h.update(hashlib.sha256(text.encode("utf-8")).digest())
    for f in sorted(model_dir.iterdir()):
        if f.is_file() and f.suffix in TOKENIZER_SUFFIXES:
            h.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


ORDINARY_CODE = 25_000  # the teacher's held-out split: its first 25k tokens are ordinary code (docs/TEACHER.md)


def ordinary_code(heldout: np.ndarray, n: int) -> list[int]:
    """The first ``n`` held-out tokens (ordinary code; later ones are code-page tables and
    pydoc text, which would flatter every row)."""
    if n > ORDINARY_CODE:
        raise ConfigError(f"the held-out split holds {ORDINARY_CODE} tokens of ordinary code; asked for {n}")
    return heldout[:n].astype(np.int64).tolist()


def text_tokens(model_dir: Path, path: Path, n: int) -> list[int]:
    """The first ``n`` tokens of ``path`` (a text file, or a directory's ``*.py`` files in
    sorted order, an end-of-text token after each) in the model's tokenizer."""
    from edge0.backend import nn as bnn

    if path.is_dir():
        files = sorted(p for p in path.rglob("*.py") if p.is_file())
    elif path.is_file():
        files = [path]
    else:
        raise ConfigError(f"--text {path}: no such file or directory")
    tok = bnn.load_tokenizer(Path(model_dir))
    out: list[int] = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--text: {f} cannot be read as UTF-8 text ({type(e).__name__})") from None
        out += list(tok.encode(text)) + [EOS]
        if len(out) >= n:
            return out[:n]
    raise ConfigError(f"--text {path}: {len(out)} tokens, fewer than the {n} asked for (--tokens)")


def prompts(stream: np.ndarray, n: int, length: int, seed: int) -> np.ndarray:
    """``n`` random windows of ``length`` tokens from ``stream`` (int32 [n, length])."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, stream.size - length - 1, size=n)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


def sample(model, prompt_rows: np.ndarray, new_tokens: int, *, temp: float, seed: int, batch: int = 16,
           progress=None, dp=None) -> np.ndarray:
    """Continue every prompt by ``new_tokens`` sampled tokens (temperature ``temp``) with a
    batched KV cache; returns int32 [n, P + new_tokens].  Under a data-parallel group
    (``dp``, edge0.train.parallel) each rank samples its share of the batches, with the
    random key each batch has in one process, and the rows are put back together."""
    key = mx.random.key(seed)
    starts = range(0, len(prompt_rows), batch)
    parts = {}
    for i, start in enumerate(starts):
        if dp is not None and not dp.mine(i):
            for _ in range(new_tokens):  # the key this batch would have used, skipped
                key, _ = mx.random.split(key)
            continue
        parts[i] = _sample_batch(model, prompt_rows[start:start + batch], new_tokens, temp, key)
        for _ in range(new_tokens):
            key, _ = mx.random.split(key)
        if progress is not None:
            progress(min(start + batch, len(prompt_rows)), len(prompt_rows))
    lengths = [len(prompt_rows[start:start + batch]) for start in starts]
    if dp is not None:
        return dp.assemble(lengths, parts).astype(np.int32)
    return np.concatenate([parts[i] for i in range(len(lengths))]).astype(np.int32)


def _sample_batch(model, prompt_rows: np.ndarray, new_tokens: int, temp: float, key) -> np.ndarray:
    from mlx_lm.models.cache import make_prompt_cache

    rows = mx.array(prompt_rows)
    cache = make_prompt_cache(model)
    logits = model(rows, cache=cache)[:, -1].astype(mx.float32)
    tokens = [rows]
    for _ in range(new_tokens):
        key, sub = mx.random.split(key)
        nxt = mx.random.categorical(logits / temp, key=sub)[:, None].astype(mx.int32) if temp > 0 \
            else mx.argmax(logits, axis=-1)[:, None].astype(mx.int32)
        tokens.append(nxt)
        logits = model(nxt, cache=cache)[:, -1].astype(mx.float32)
        mx.eval(logits)
    return np.array(mx.concatenate(tokens, axis=1))


def continuation_mask(rows: np.ndarray, prompt_len: int) -> np.ndarray:
    """float32 [n, T-1]: 1 where position t+1 is a continuation token to learn (after the
    prompt, up to and including the first end-of-text token), else 0."""
    n, T = rows.shape
    mask = np.zeros((n, T - 1), dtype=np.float32)
    for i, row in enumerate(rows):
        cont = row[prompt_len:]
        stop = np.flatnonzero(cont == EOS)
        end = prompt_len + (int(stop[0]) + 1 if stop.size else len(cont))
        mask[i, prompt_len - 1:end - 1] = 1.0
    return mask


def cache_key(*parts) -> str:
    """A short stable key of what determines a data file (its cache name)."""
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:12]


def save_rows(path: Path, rows: np.ndarray, prompt_len: int, meta: dict) -> None:
    """Rows and their metadata, each written beside and renamed into place (the rows last),
    so that a reader never finds half a file."""
    meta_path = Path(str(path) + ".json")
    tmp = meta_path.with_name(meta_path.name + ".tmp")
    tmp.write_text(json.dumps(dict(meta, prompt_len=prompt_len, shape=list(rows.shape)), indent=1))
    tmp.replace(meta_path)
    with open(path.with_name(path.name + ".tmp"), "wb") as f:
        np.save(f, rows)
    path.with_name(path.name + ".tmp").replace(path)


def rows_cached(path: Path) -> bool:
    """Whether ``save_rows`` left both the rows and their metadata at ``path`` (rows copied
    without their ``.json`` are not a cache: they are written again)."""
    return Path(path).exists() and Path(str(path) + ".json").exists()


def load_rows(path: Path) -> tuple[np.ndarray, int, dict]:
    from edge0.errors import CheckpointError

    meta_path = Path(str(path) + ".json")
    try:
        meta = json.loads(meta_path.read_text())
        prompt_len = int(meta["prompt_len"])
        rows = np.load(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"cached training rows cannot be read ({type(e).__name__}: {e}); delete "
                              f"{Path(path).name} and its .json to write them again", file=path) from None
    return rows, prompt_len, meta
