"""Quality of a checkpoint on held-out tokens: perplexity, agreement with a teacher, routing.

Function API (all numbers per predicted token, natural log):

- :func:`evaluate_tokens` -- perplexity of ``model`` on a token stream and, with a
  ``teacher``, top-1 agreement (argmax equal) and mean KL(teacher || model);
- :func:`unigram_perplexity` -- the baseline: train-set token frequencies with add-one
  smoothing;
- :func:`routing_load` -- per MoE layer, the entropy of expert usage (normalised by
  log E) and the max-load share, on the same windows;
- :func:`load_model` / :func:`load_tokens` -- mlx-lm's resident classes with float32
  activations, and ``.npy`` token ids or text files.

Windows: the stream is cut into windows of ``seq_len + 1`` tokens that overlap by one
token, so every token after the first is predicted exactly once, with up to ``seq_len``
tokens of context (restarting at each window).  Teacher and student see the same windows.

Like ``edge0.tiny``, this works on mlx-lm's own model classes (not the streaming engine):
it is the ground truth the engine is compared against.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from edge0.backend import core as B

__all__ = [
    "EvalResult",
    "LayerLoad",
    "load_model",
    "load_tokens",
    "windows",
    "evaluate_tokens",
    "unigram_perplexity",
    "routing_load",
]


@dataclass(frozen=True)
class EvalResult:
    n_tokens: int  # predicted tokens
    nll: float  # mean negative log-likelihood, nats/token
    perplexity: float
    top1_agreement: float | None = None  # share of positions where argmax(model) == argmax(teacher)
    kl: float | None = None  # mean KL(teacher || model), nats/token
    teacher_nll: float | None = None
    teacher_perplexity: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LayerLoad:
    layer: str  # path of the layer's SwitchGLU
    n_experts: int
    assignments: int  # token -> expert assignments counted (tokens x k)
    entropy: float  # entropy of the expert-usage distribution / log(E), in [0, 1]
    max_share: float  # largest expert's share of the assignments (1/E when balanced)
    unused: int  # experts never selected
    counts: tuple[int, ...]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["counts"] = list(self.counts)
        return d


def load_model(path: Path | str, dtype=mx.float32):
    """``(model, tokenizer)`` via ``mlx_lm.load``, floats cast to ``dtype`` (default
    float32: bf16 activations make the CPU's quantized matmuls ~8x slower)."""
    from mlx_lm import load

    from edge0.backend import nn as bnn

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    model, tokenizer = load(str(path))
    bnn.cast_model(model, dtype)
    mx.eval(model.parameters())
    return model, tokenizer


def load_tokens(path: Path | str, tokenizer=None) -> np.ndarray:
    """Token ids (int32) from a ``.npy`` file of ids, or from a text file encoded with
    ``tokenizer`` (required then)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"held-out data {path} does not exist")
    if path.suffix == ".npy":
        arr = np.load(path, allow_pickle=False)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{path}: expected a 1-D array of integer token ids, got {arr.dtype} {arr.shape}")
        return arr.astype(np.int32)
    if tokenizer is None:
        raise ValueError(f"{path} is text; a tokenizer is needed to encode it")
    text = path.read_text(encoding="utf-8")
    return np.asarray(tokenizer.encode(text), dtype=np.int32)


def windows(tokens: np.ndarray, seq_len: int, max_tokens: int | None = None) -> np.ndarray:
    """``[n, seq_len + 1]`` int32 windows with stride ``seq_len`` covering the first
    ``max_tokens + 1`` tokens (a shorter last window is dropped unless it is the only one)."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    tokens = np.asarray(tokens, dtype=np.int32)
    if max_tokens is not None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be >= 1")
        tokens = tokens[: max_tokens + 1]
    if tokens.size < 2:
        raise ValueError(f"need at least 2 tokens to evaluate, got {tokens.size}")
    n = (tokens.size - 1) // seq_len
    if n == 0:
        return tokens[None, :]
    return np.stack([tokens[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])


def evaluate_tokens(model: nn.Module, tokens: np.ndarray, *, teacher: nn.Module | None = None,
                    seq_len: int = 256, max_tokens: int | None = None, batch_size: int = 8) -> EvalResult:
    """Perplexity of ``model`` on ``tokens``; with ``teacher`` also top-1 agreement and
    mean KL(teacher || model) over the same predicted positions."""
    win = windows(tokens, seq_len, max_tokens)
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    nll_sum = 0.0
    t_nll_sum = 0.0
    agree = 0
    kl_sum = 0.0
    count = 0
    for i in range(0, win.shape[0], batch_size):
        chunk = mx.array(win[i:i + batch_size])
        x, y = chunk[:, :-1], chunk[:, 1:]
        logp, picked = B.score_tokens(model(x), y)
        parts = [-mx.sum(picked)]
        if teacher is not None:
            logq, t_picked = B.score_tokens(teacher(x), y)
            t_nll = -t_picked
            same = mx.argmax(logp, axis=-1) == mx.argmax(logq, axis=-1)
            kl = mx.sum(mx.exp(logq) * (logq - logp), axis=-1)
            parts += [mx.sum(t_nll), mx.sum(same), mx.sum(kl)]
        mx.eval(parts)
        nll_sum += parts[0].item()
        if teacher is not None:
            t_nll_sum += parts[1].item()
            agree += int(parts[2].item())
            kl_sum += parts[3].item()
        count += int(y.size)
    nll_mean = nll_sum / count
    if teacher is None:
        return EvalResult(n_tokens=count, nll=nll_mean, perplexity=math.exp(nll_mean))
    t_mean = t_nll_sum / count
    return EvalResult(n_tokens=count, nll=nll_mean, perplexity=math.exp(nll_mean),
                      top1_agreement=agree / count, kl=kl_sum / count,
                      teacher_nll=t_mean, teacher_perplexity=math.exp(t_mean))


def unigram_perplexity(train_counts: np.ndarray, tokens: np.ndarray, *, vocab_size: int | None = None,
                       seq_len: int | None = None, max_tokens: int | None = None) -> EvalResult:
    """Perplexity of the add-one-smoothed unigram model of ``train_counts`` on ``tokens``.

    With ``seq_len`` (and ``max_tokens``) it scores exactly the positions
    :func:`evaluate_tokens` predicts with the same arguments."""
    counts = np.asarray(train_counts, dtype=np.float64)
    if counts.ndim != 1:
        raise ValueError("train_counts must be a 1-D array of per-token counts")
    vocab = int(vocab_size or counts.size)
    if vocab < counts.size:
        raise ValueError(f"vocab_size={vocab} is smaller than the counts array ({counts.size})")
    counts = np.pad(counts, (0, vocab - counts.size))
    logp = np.log((counts + 1.0) / (counts.sum() + vocab))
    if seq_len is not None:
        targets = windows(tokens, seq_len, max_tokens)[:, 1:].reshape(-1)
    else:
        toks = np.asarray(tokens, dtype=np.int64)
        targets = toks[: (max_tokens + 1 if max_tokens else None)][1:]
    if targets.size == 0:
        raise ValueError("no tokens to score")
    if targets.max() >= vocab or targets.min() < 0:
        raise ValueError(f"token ids outside [0, {vocab})")
    nll = float(-logp[targets].mean())
    return EvalResult(n_tokens=int(targets.size), nll=nll, perplexity=math.exp(nll))


def routing_load(model: nn.Module, tokens: np.ndarray, *, seq_len: int = 256,
                 max_tokens: int | None = None, batch_size: int = 8) -> list[LayerLoad]:
    """Per MoE layer (each mlx-lm ``SwitchGLU``), how the routed assignments spread over
    the experts on the windows of ``tokens``.

    Temporarily patches ``SwitchGLU.__call__`` at class level to count the routing
    indices: do not run other mlx-lm forwards concurrently."""
    from mlx_lm.models.switch_layers import SwitchGLU

    names = {id(m): name for name, m in model.named_modules() if isinstance(m, SwitchGLU)}
    if not names:
        raise ValueError("routing_load: the model has no SwitchGLU (MoE) layer")
    sizes = {id(m): int(m.gate_proj.num_experts) for _, m in model.named_modules() if isinstance(m, SwitchGLU)}
    counts = {mid: np.zeros(sizes[mid], dtype=np.int64) for mid in names}
    pending: list[tuple[int, mx.array]] = []
    original = SwitchGLU.__call__

    def counting_call(self, x, indices):
        n = sizes[id(self)]
        pending.append((id(self), mx.sum(indices.reshape(-1, 1) == mx.arange(n), axis=0)))
        return original(self, x, indices)

    win = windows(tokens, seq_len, max_tokens)
    SwitchGLU.__call__ = counting_call
    try:
        for i in range(0, win.shape[0], batch_size):
            x = mx.array(win[i:i + batch_size, :-1])
            logits = model(x)
            mx.eval(logits, [c for _, c in pending])
            for mid, c in pending:
                counts[mid] += np.array(c, dtype=np.int64)
            pending.clear()
    finally:
        SwitchGLU.__call__ = original

    def natural(item):  # model.layers.10 after model.layers.9
        return [int(t) if t.isdigit() else t for t in item[1].split(".")]

    out = []
    for mid, name in sorted(names.items(), key=natural):
        c = counts[mid]
        total = int(c.sum())
        share = c / max(total, 1)
        nz = share[share > 0]
        n_exp = c.size
        entropy = float(-(nz * np.log(nz)).sum() / math.log(n_exp)) if n_exp > 1 else 1.0
        out.append(LayerLoad(layer=name, n_experts=n_exp, assignments=total, entropy=entropy,
                             max_share=float(share.max()) if total else 0.0,
                             unused=int((c == 0).sum()), counts=tuple(int(v) for v in c)))
    return out


def default_seq_len(model_dir: Path | str, fallback: int = 256) -> int:
    """The training context of a checkpoint made by ``edge0.teacher`` (provenance.json),
    else ``fallback``."""
    import json

    prov = Path(model_dir) / "provenance.json"
    try:
        return int(json.loads(prov.read_text(encoding="utf-8"))["train_config"]["seq_len"])
    except (OSError, KeyError, ValueError, TypeError):
        return fallback


def format_loads(loads: Sequence[LayerLoad]) -> str:
    """A small text table of :func:`routing_load`'s result."""
    lines = ["| layer | experts | entropy / log E | max-load share | unused |", "|---|---:|---:|---:|---:|"]
    for ld in loads:
        lines.append(f"| {ld.layer} | {ld.n_experts} | {ld.entropy:.3f} | {ld.max_share:.3f} | {ld.unused} |")
    return "\n".join(lines)
