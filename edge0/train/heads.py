"""Phase-1 training of the prerouter heads (``edge0 train heads``).

1. Traces: the frozen int4 base runs over text (teacher forcing, exact path); each MoE layer
   reports its post-attention-norm input, the experts it routed to and its router logits.
2. Pairs for the head owned by l: input (x_l(t), experts_l(t), experts_l(t-1)), target
   layer l+1's router logits at t+1.
3. Only the heads train, warm-started from the next router, on the router's distribution
   (soft cross-entropy for softmax routing, binary cross-entropy on the sigmoid scores for
   sigmoid routing), so they learn to predict routing rather than to fit text.
4. recall@k and top-1 agreement per layer on held-out text, before and after, computed
   through the family's routing function (the math used at decode).
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.config import EngineConfig
from edge0.errors import ConfigError
from edge0.prerouter.files import HEADS_FILENAME, checkpoint_identity, save_heads
from edge0.prerouter.heads import PrerouterHeads, eligible_owners
from edge0.routing import make_route_fn
from edge0.spec import SigmoidGroup


@dataclass
class Traces:
    x: dict  # owner -> [N, D] float32 (NumPy)
    inds_t: dict  # owner -> [N, k]
    inds_prev: dict  # owner -> [N, k] (-1 rows: no previous token)
    target: dict  # owner -> [N, E] router logits of owner+1 at t+1

    def size(self) -> int:
        return len(next(iter(self.x.values()))) if self.x else 0


def default_texts() -> tuple[list[str], list[str], str]:
    """Python standard-library sources, split by file (every 5th file held out)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if not p.name.startswith("test"))[:120]
    train, held = [], []
    for p in files:
        text = p.read_text(encoding="utf-8", errors="replace")
        (held if int(hashlib.sha256(p.name.encode()).hexdigest(), 16) % 5 == 0 else train).append(text)
    return train, held, f"python {sysconfig.get_python_version()} stdlib *.py (first 120 by name), held out by file hash"


def texts_from(path: str) -> tuple[list[str], list[str], str]:
    p = Path(path)
    files = sorted(p.rglob("*") if p.is_dir() else [p])
    files = [f for f in files if f.is_file() and f.suffix in (".py", ".txt", ".md")]
    if not files:
        raise ConfigError(f"--data {path}: no .py, .txt or .md files")
    train, held = [], []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        (held if int(hashlib.sha256(str(f).encode()).hexdigest(), 16) % 5 == 0 else train).append(text)
    if not held or not train:  # one file: split it
        text = "\n".join(train + held)
        cut = int(len(text) * 0.8)
        train, held = [text[:cut]], [text[cut:]]
    return train, held, f"{path} ({len(files)} files), held out by file hash"


def token_chunks(tokenizer, texts: list[str], total: int, seq_len: int) -> list[list[int]]:
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer.encode(t))
        if len(ids) >= total:
            break
    ids = ids[:total]
    return [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)] or [ids]


def collect_traces(streaming, chunks: list[list[int]], owners: list[int]) -> Traces:
    blocks = streaming.blocks()
    want = set(owners) | {o + 1 for o in owners}
    captured: dict[int, tuple] = {}

    def observe(layer, x, inds):
        if layer in want:
            captured[layer] = (x, inds, blocks[layer].router_logits(x))

    for layer in want:
        blocks[layer].observer = observe
    xs, it, ip, tg = ({o: [] for o in owners} for _ in range(4))
    try:
        for chunk in chunks:
            captured.clear()
            B.eval(streaming.model(B.array([chunk])))
            for o in owners:
                x, inds, _ = captured[o]
                logits_next = captured[o + 1][2]
                x, inds = B.to_host(x.astype(B.float32))[0], B.to_host(inds)[0]
                nxt = B.to_host(logits_next.astype(B.float32))[0]
                n = len(chunk) - 1  # pairs (t, t+1)
                prev = np.concatenate([np.full((1, inds.shape[1]), -1), inds[:-1]])
                xs[o].append(x[:n]); it[o].append(inds[:n]); ip[o].append(prev[:n]); tg[o].append(nxt[1:n + 1])
    finally:
        for layer in want:
            blocks[layer].observer = None
    cat = lambda d: {o: np.concatenate(v) for o, v in d.items()}
    return Traces(cat(xs), cat(it), cat(ip), cat(tg))


def _predict(heads: PrerouterHeads, owner: int, x, inds_t, inds_prev):
    dtype = heads.head(owner).residual.weight.dtype
    on_t = B.one_hot_k(inds_t, heads.experts, dtype)
    on_prev = B.one_hot_k(B.maximum(inds_prev, 0), heads.experts, dtype) * (inds_prev[..., :1] >= 0).astype(dtype)
    return heads.head(owner)(x.astype(dtype), on_t, on_prev).astype(B.float32)


def evaluate(heads: PrerouterHeads, traces: Traces, route, bias_of) -> dict[int, dict]:
    """Per owner: recall@k and top-1 agreement of the predicted routing of layer owner+1."""
    out = {}
    for o in heads.owners:
        pred = _predict(heads, o, B.array(traces.x[o]), B.array(traces.inds_t[o]), B.array(traces.inds_prev[o]))
        p_inds, p_scores = route(pred, bias_of(o + 1))
        t_inds, t_scores = route(B.array(traces.target[o]), bias_of(o + 1))
        p_inds, t_inds = B.to_host(p_inds), B.to_host(t_inds)
        p_top = p_inds[np.arange(len(p_inds)), B.to_host(p_scores.astype(B.float32)).argmax(-1)]
        t_top = t_inds[np.arange(len(t_inds)), B.to_host(t_scores.astype(B.float32)).argmax(-1)]
        k = p_inds.shape[-1]
        recall = np.mean([len(set(a) & set(b)) / k for a, b in zip(p_inds.tolist(), t_inds.tolist())])
        out[o] = {"recall_at_k": float(recall), "top1": float(np.mean(p_top == t_top))}
    return out


def _loss_fn(family_sigmoid: bool):
    def loss(heads, x, it, ip, target, owner):
        pred = _predict(heads, owner, x, it, ip)
        if family_sigmoid:
            p = B.sigmoid(target)
            return -(p * bnn.log_sigmoid(pred) + (1 - p) * bnn.log_sigmoid(-pred)).mean()
        return -(B.softmax(target, axis=-1) * B.log_softmax(pred)).sum(-1).mean()
    return loss


def stream_chunks(stream: np.ndarray, total: int, seq_len: int) -> list[list[int]]:
    """Consecutive ``seq_len`` windows covering the first ``total`` tokens of ``stream``."""
    ids = stream[:total].astype(np.int64).tolist()
    return [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)] or [ids]


def train_heads(model_dir: str | Path, *, data: str | None = None, tokens: int = 20000, heldout_tokens: int = 4000,
                seq_len: int = 128, steps: int = 300, batch: int = 256, lr: float = 1e-3, width: int = 512,
                owners: list[int] | None = None, out: str | Path | None = None, seed: int = 0,
                progress=None, streams: tuple[np.ndarray, np.ndarray, str] | None = None,
                experts_per_token: int | None = None) -> dict:
    """``streams``: (train tokens, held-out tokens, description) to trace instead of text
    (the recipe passes the model's own training split)."""
    from edge0.loader import load_streaming_model

    model_dir = Path(model_dir)
    streaming = load_streaming_model(model_dir, EngineConfig(prerouter="off", adapter="off",
                                                             experts_per_token=experts_per_token))
    try:
        spec = streaming.spec
        eligible = eligible_owners(spec)
        owners = eligible if owners is None else [o for o in owners if o in eligible]
        if not owners:
            raise ConfigError(f"no owner layer to train: eligible owners are {eligible}")
        if streams is not None:
            train_stream, held_stream, description = streams
            train_chunks = stream_chunks(train_stream, tokens, seq_len)
            held_chunks = stream_chunks(held_stream, heldout_tokens, seq_len)
        else:
            tokenizer = bnn.load_tokenizer(model_dir)
            train_texts, held_texts, description = texts_from(data) if data else default_texts()
            train_chunks = token_chunks(tokenizer, train_texts, tokens, seq_len)
            held_chunks = token_chunks(tokenizer, held_texts, heldout_tokens, seq_len)
        tr = collect_traces(streaming, train_chunks, owners)
        he = collect_traces(streaming, held_chunks, owners)
        blocks = streaming.blocks()
        route = make_route_fn(spec)
        bias_of = (lambda l: getattr(blocks[l].gate, spec.router_bias_attr)) if spec.router_bias_attr else (lambda l: None)
        B.seed(seed)  # before the heads are built: their initialisation draws from it
        heads = PrerouterHeads(owners, spec.hidden_size, spec.num_experts, spec.k, width)
        heads.warm_start({o + 1: bnn.router_weight(blocks[o + 1].gate, spec.router_kind) for o in owners})
        heads16 = lambda: _cast(heads, B.float16)
        before = evaluate(heads16(), he, route, bias_of)
        loss_fn = _loss_fn(isinstance(spec.routing, SigmoidGroup))
        opt = bnn.adamw(lr)
        rng = np.random.default_rng(seed)

        def total(model, batches):
            return sum(loss_fn(model, *b, o) for o, b in batches.items())

        step_fn = bnn.value_and_grad(heads, total)
        n = tr.size()
        losses = []
        for step in range(steps):
            idx = rng.integers(0, n, size=min(batch, n))
            batches = {o: (B.array(tr.x[o][idx]), B.array(tr.inds_t[o][idx]), B.array(tr.inds_prev[o][idx]),
                           B.array(tr.target[o][idx])) for o in owners}
            loss, grads = step_fn(heads, batches)
            opt.update(heads, grads)
            B.eval(heads.parameters(), opt.state, loss)
            losses.append(float(B.to_host(loss)))
            if progress is not None:
                progress(step + 1, steps, losses[-1])
        after = evaluate(heads16(), he, route, bias_of)
        recipe = dict(phase=1, steps=steps, batch=batch, lr=lr, width=width, seq_len=seq_len, tokens=tr.size(),
                      experts_per_token=spec.k,
                      heldout_tokens=he.size(), seed=seed, owners=owners, loss="soft-CE" if not isinstance(
                          spec.routing, SigmoidGroup) else "BCE", warm_start="next router")
        path = Path(out) if out else model_dir / HEADS_FILENAME
        save_heads(heads, path, base_identity=checkpoint_identity(model_dir), recipe=recipe,
                   training_data=description)
        return {"path": str(path), "before": before, "after": after, "losses": losses, "recipe": recipe}
    finally:
        streaming.close()


def make_warm_heads(model_dir: str | Path, out: str | Path, width: int = 512) -> Path:
    """Untrained heads (each is its next router applied to its own hidden state), written
    without collecting traces: a fast stand-in for speed benchmarks, where what matters is
    that a prediction drives the reads, not how good it is."""
    from edge0.loader import load_streaming_model

    streaming = load_streaming_model(Path(model_dir), EngineConfig(prerouter="off", adapter="off"))
    try:
        spec, blocks = streaming.spec, streaming.blocks()
        owners = eligible_owners(spec)
        heads = PrerouterHeads(owners, spec.hidden_size, spec.num_experts, spec.k, width)
        heads.warm_start({o + 1: bnn.router_weight(blocks[o + 1].gate, spec.router_kind) for o in owners})
        return save_heads(heads, out, base_identity=checkpoint_identity(model_dir),
                          recipe=dict(phase=0, steps=0, warm_start="next router", width=width, owners=owners),
                          training_data="none (warm start only)")
    finally:
        streaming.close()


def _cast(heads: PrerouterHeads, dtype) -> PrerouterHeads:
    copy = PrerouterHeads(heads.owners, heads.hidden, heads.experts, heads.k, heads.width)
    bnn.load_parameters_flat(copy, {k: v.astype(dtype) for k, v in bnn.parameters_flat(heads).items()})
    return copy
