"""Phase-1 training of the prerouter heads (``edge0 train heads``).

1. Traces: the frozen int4 base runs over text (teacher forcing, exact path); each MoE layer
   reports its router's input, the experts its block routed to and its router logits.
2. Pairs for the head owned by l: input (x_l(t), experts_l(t), experts_l(t-1)), target
   the router logits at t+1 of its consumer c, the next MoE layer (l+1 where every layer
   is MoE).
3. Only the heads train, warm-started from the next router, on the router's distribution
   (soft cross-entropy for softmax routing, binary cross-entropy on the sigmoid scores for
   sigmoid routing), so they learn to predict routing rather than to fit text.
4. recall@k and top-1 agreement per layer on held-out text, before and after, computed
   through the consumer block's own routing code (the math used at decode).
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.config import EngineConfig
from edge0.errors import ConfigError
from edge0.prerouter.files import HEADS_FILENAME, checkpoint_identity, save_heads
from edge0.prerouter.heads import WIDTH, PrerouterHeads, eligible_owners
from edge0.train.parallel import DataParallel


@dataclass
class Traces:
    x: dict  # owner -> [N, D] float32 (NumPy)
    inds_t: dict  # owner -> [N, k]
    inds_prev: dict  # owner -> [N, k] (-1 rows: no previous token)
    target: dict  # owner -> [N, E] router logits of owner+1 at t+1
    tok: np.ndarray | None = None  # [N] the token at t+1 (the one the next step decodes)

    def size(self) -> int:
        return len(next(iter(self.x.values()))) if self.x else 0

    def save(self, path: Path, key: str) -> None:
        """One .npz file; ``key`` names what was traced (model, tokens, layers)."""
        arrays = {"key": np.array(key), "tok": self.tok}
        for name in ("x", "inds_t", "inds_prev", "target"):
            for o, v in getattr(self, name).items():
                arrays[f"{name}/{o}"] = v
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **arrays)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, key: str) -> "Traces | None":
        """The traces saved at ``path`` when they were made for ``key``, else None."""
        if not path.is_file():
            return None
        with np.load(path) as f:
            if str(f["key"]) != key:
                return None
            parts: dict = {"x": {}, "inds_t": {}, "inds_prev": {}, "target": {}}
            for name in f.files:
                if "/" in name:
                    field, o = name.split("/")
                    parts[field][int(o)] = f[name]
            return cls(**parts, tok=f["tok"])


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


def collect_traces(streaming, chunks: list[list[int]], owners: list[int], dp: DataParallel | None = None,
                   progress=None) -> Traces:
    """Run the model over ``chunks`` (teacher forcing) and record, for every owner layer, its
    router's input and the experts its block routed to, and its consumer's router logits.
    Under a data-parallel group each rank traces its share of the chunks and every rank
    ends with all the traces, in chunk order. ``progress(done, total)`` after each chunk."""
    dp = dp or DataParallel(None)
    from edge0.prerouter.heads import consumer_of

    routers, switches = streaming.routers(), streaming.switches()
    consumer = {o: consumer_of(streaming.spec, o) for o in owners}
    want = set(owners) | set(consumer.values())
    seen: dict[tuple[int, str], object] = {}
    for layer in want:
        routers[layer].watch = lambda l, x, tap: seen.update({(l, "x"): x, (l, "logits"): tap.logits(x)})
        switches[layer].observer = lambda l, inds: seen.__setitem__((l, "inds"), inds)
    parts: dict[int, dict] = {}
    try:
        for ci, chunk in enumerate(chunks):
            if not dp.mine(ci):
                continue
            seen.clear()
            B.eval(streaming.model(B.array([chunk])))
            n = len(chunk) - 1  # pairs (t, t+1)
            part = parts[ci] = {"tok": np.asarray(chunk[1:n + 1], dtype=np.int32)}
            for o in owners:
                x = B.to_host(seen[o, "x"].astype(B.float32)).reshape(len(chunk), -1)
                inds = B.to_host(seen[o, "inds"]).reshape(len(chunk), -1).astype(np.int32)
                nxt = B.to_host(seen[consumer[o], "logits"].astype(B.float32)).reshape(len(chunk), -1)
                prev = np.concatenate([np.full((1, inds.shape[1]), -1, dtype=np.int32), inds[:-1]])
                part.update({f"x/{o}": x[:n], f"inds_t/{o}": inds[:n], f"inds_prev/{o}": prev[:n],
                             f"target/{o}": nxt[1:n + 1]})
            if progress is not None:
                progress(ci + 1, len(chunks))
    finally:
        for layer in want:
            routers[layer].watch = switches[layer].observer = None
    keys = ["tok"] + [f"{name}/{o}" for name in ("x", "inds_t", "inds_prev", "target") for o in owners]
    full = dp.assemble_dict([len(c) - 1 for c in chunks], parts, keys)
    field = lambda name: {o: full[f"{name}/{o}"] for o in owners}
    return Traces(field("x"), field("inds_t"), field("inds_prev"), field("target"), full["tok"])


def _predict(heads: PrerouterHeads, owner: int, x, inds_t, inds_prev, tok=None):
    """``tok``: the token embeddings [N, token_dim] (heads that see the token)."""
    dtype = heads.head(owner).residual.weight.dtype
    on_t = B.one_hot_k(inds_t, heads.experts, dtype)
    on_prev = B.one_hot_k(B.maximum(inds_prev, 0), heads.experts, dtype) * (inds_prev[..., :1] >= 0).astype(dtype)
    tok = tok.astype(dtype) if heads.sees_token else None
    return heads.head(owner)(x.astype(dtype), on_t, on_prev, tok).astype(B.float32)


def _embedded(streaming, ids: np.ndarray, heads: PrerouterHeads):
    """The token embeddings the heads see, or None for heads without the token input."""
    if not heads.sees_token:
        return None
    return streaming.embed(B.array(ids.astype(np.int32))).astype(B.float32)


def evaluate(heads: PrerouterHeads, traces: Traces, streaming, extras: tuple[int, ...] = ()) -> dict[int, dict]:
    """Per owner: recall@k of the predicted routing of its consumer layer against the routing its
    router's own logits give (both through the consumer block's routing code), top-1
    agreement of the two logit vectors, and for each m in ``extras`` the share of the
    true k inside the predicted top k+m (routed by the consumer's code at width k+m: what
    select routing stages)."""
    out = {}
    tok = _embedded(streaming, traces.tok, heads)
    for o in heads.owners:
        pred = _predict(heads, o, B.array(traces.x[o]), B.array(traces.inds_t[o]), B.array(traces.inds_prev[o]), tok)
        true = B.array(traces.target[o])
        c = heads.consumer[o]
        p_inds = B.to_host(streaming.route(c, pred))
        t_inds = B.to_host(streaming.route(c, true))
        k = p_inds.shape[-1]
        recall = _coverage(p_inds, t_inds, k)
        top1 = np.mean(B.to_host(pred).argmax(-1) == traces.target[o].argmax(-1))
        out[o] = {"recall_at_k": float(recall), "top1": float(top1)}
        for m in extras:
            wide = B.to_host(streaming.route(c, pred, width=k + m))
            out[o][f"recall_at_k+{m}"] = float(_coverage(wide, t_inds, k))
    return out


def _coverage(predicted: np.ndarray, true: np.ndarray, k: int) -> float:
    """Mean share of each row's ``true`` experts found among its ``predicted`` ones."""
    return float(np.mean((predicted[:, :, None] == true[:, None, :]).any(axis=1).sum(-1) / k))


def _sigmoid_routed(streaming) -> bool:
    """Whether the routers' scores are sigmoids (trained with binary cross-entropy) rather
    than a softmax: guessed from a score-correction bias beside the router, which only
    sigmoid routers carry in mlx-lm's models."""
    for layer in streaming.spec.moe_layers:
        block = streaming.blocks()[layer]
        for name, value in bnn.parameters_flat(block).items():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("e_score_correction_bias", "expert_bias", "router_bias") or leaf.endswith("correction_bias"):
                return True
    return False


def _loss_fn(family_sigmoid: bool):
    def loss(heads, x, it, ip, target, tok, owner):
        pred = _predict(heads, owner, x, it, ip, tok)
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
                experts_per_token: int | None = None, token_input: bool = False,
                traces_dir: str | Path | None = None, extras: tuple[int, ...] = (),
                serving: dict | None = None, dp: DataParallel | None = None, trace_say=None) -> dict:
    """``streams``: (train tokens, held-out tokens, description) to trace instead of text
    (the recipe passes the model's own training split). ``token_input``: heads also see
    the embedding of the token the next step decodes. ``traces_dir``: keep the traces
    there and reuse them when the same model, text and settings are traced again (heads
    variants then train without tracing). ``extras``: also report recall@(k+m) for each m.
    ``serving``: the routing recorded in the file as the heads' default. ``trace_say``:
    where to say that the tracing starts (with a progress bar of it). ``dp``: the
    data-parallel group (default: the one ``mlx.launch`` started, or one process): the
    ranks trace their shares of the text and step on their parts of each batch; rank 0
    writes the traces and the heads."""
    dp = dp or DataParallel.current()
    from edge0.loader import load_streaming_model

    model_dir = Path(model_dir)
    streaming = load_streaming_model(model_dir, EngineConfig(prerouter="off", adapter="off", pipeline="off",
                                                             experts_per_token=experts_per_token,
                                                             kernels="mlx"))  # training: MLX's kernels
    try:
        spec = streaming.spec
        if spec.prerouter_problem:
            raise ConfigError(f"{spec.model_type} cannot be driven by prerouter heads: {spec.prerouter_problem}")
        eligible = eligible_owners(spec)
        owners = eligible if owners is None else [o for o in owners if o in eligible]
        if not owners:
            raise ConfigError(f"no owner layer to train: eligible owners are {eligible}")
        if token_input and streaming.embed is None:
            raise ConfigError(f"{spec.model_type}: no token embedding found, so heads cannot see the token")
        if streams is not None:
            train_stream, held_stream, description = streams
            train_chunks = stream_chunks(train_stream, tokens, seq_len)
            held_chunks = stream_chunks(held_stream, heldout_tokens, seq_len)
        else:
            tokenizer = bnn.load_tokenizer(model_dir)
            train_texts, held_texts, description = texts_from(data) if data else default_texts()
            train_chunks = token_chunks(tokenizer, train_texts, tokens, seq_len)
            held_chunks = token_chunks(tokenizer, held_texts, heldout_tokens, seq_len)
        say = trace_say if dp.is_main else None
        tr = _traced(streaming, train_chunks, owners, traces_dir, "train", model_dir, experts_per_token, dp, say)
        he = _traced(streaming, held_chunks, owners, traces_dir, "heldout", model_dir, experts_per_token, dp, say)
        routers = streaming.routers()
        B.seed(seed)  # before the heads are built: their initialisation draws from it
        token_dim = streaming.embed_dim if token_input else 0
        heads = _new_heads(spec, routers, owners, width, token_dim)
        heads16 = lambda: _cast(heads, B.float16)
        before = evaluate(heads16(), he, streaming, extras)
        sigmoid = _sigmoid_routed(streaming)
        losses = _fit(heads, tr, streaming, owners, _loss_fn(sigmoid), steps=steps, batch=batch, lr=lr, seed=seed,
                      dp=dp, progress=progress)
        after = evaluate(heads16(), he, streaming, extras)
        recipe = dict(phase=1, steps=steps, batch=batch, lr=lr, width=width, seq_len=seq_len, tokens=tr.size(),
                      experts_per_token=spec.k, inputs=list(heads.inputs),
                      heldout_tokens=he.size(), seed=seed, owners=owners,
                      consumers={str(o): c for o, c in zip(heads.owners, heads.consumers())}, loss="BCE" if sigmoid else "soft-CE",
                      warm_start="next router")
        path = Path(out) if out else model_dir / HEADS_FILENAME
        if dp.is_main:
            save_heads(heads, path, base_identity=checkpoint_identity(model_dir), recipe=dict(recipe, ranks=dp.size),
                       training_data=description, serving=serving)
        return {"path": str(path), "before": before, "after": after, "losses": losses, "recipe": recipe}
    finally:
        streaming.close()


def _fit(heads: PrerouterHeads, tr: Traces, streaming, owners: list[int], loss_fn, *, steps: int, batch: int,
         lr: float, seed: int, dp: DataParallel, progress=None) -> list[float]:
    """``steps`` AdamW steps on random batches of the traces (each rank on its part of
    every batch under ``dp``); the loss at each step."""
    opt = bnn.adamw(lr)
    rng = np.random.default_rng(seed)

    def total(model, batches, tok):
        return sum(loss_fn(model, *b, tok, o) for o, b in batches.items())

    step_fn = bnn.value_and_grad(heads, total)
    n = tr.size()
    losses = []
    for step in range(steps):
        (idx,) = dp.shard((rng.integers(0, n, size=min(batch, n)),))
        batches = {o: (B.array(tr.x[o][idx]), B.array(tr.inds_t[o][idx]), B.array(tr.inds_prev[o][idx]),
                       B.array(tr.target[o][idx])) for o in owners}
        loss, grads = step_fn(heads, batches, _embedded(streaming, tr.tok[idx], heads))
        grads, (loss,) = dp.reduce(grads, (loss,), B.array(float(len(idx))))
        opt.update(heads, grads)
        B.eval(heads.parameters(), opt.state, loss)
        losses.append(float(B.to_host(loss)))
        if progress is not None:
            progress(step + 1, steps, losses[-1])
    return losses


def _traced(streaming, chunks, owners, traces_dir, name, model_dir, experts_per_token, dp, say=None) -> Traces:
    """``collect_traces``, through a file in ``traces_dir`` keyed by everything the traces
    depend on (the checkpoint, the routing width, the owners and every traced token);
    ``say``: the rank's messages (the tracing, when it runs, is said with a progress bar)."""
    def collect():
        if say is None:
            return collect_traces(streaming, chunks, owners, dp)
        from edge0.train.console import Progress

        say(f"tracing the model's routing on the {name} text ({len(chunks)} chunks; the heads train after)")
        bar = Progress(f"tracing {name}", unit="chunk")
        try:
            return collect_traces(streaming, chunks, owners, dp, bar)
        finally:
            bar.close()

    if traces_dir is None:
        return collect()
    h = hashlib.sha256(json.dumps([checkpoint_identity(model_dir), experts_per_token, owners]).encode())
    for c in chunks:
        h.update(np.asarray(c, dtype=np.int64).tobytes() + b"|")
    key = h.hexdigest()
    path = Path(traces_dir) / f"traces-{name}.npz"
    found = Traces.load(path, key)
    if not dp.any(found is None):
        return found
    traces = collect()
    if dp.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        traces.save(path, key)
    return traces


def make_warm_heads(model_dir: str | Path, out: str | Path, width: int = WIDTH, token_input: bool = True) -> Path:
    """Untrained heads (each is its next router applied to its own hidden state), written
    without collecting traces: a fast stand-in for speed benchmarks, where what matters is
    that a prediction drives the reads, not how good it is. ``token_input``: shaped as the
    heads ``edge0 train heads`` writes by default (the token path starts at zero, so the
    prediction is the same; the flush costs what a trained head's does)."""
    from edge0.loader import load_streaming_model

    streaming = load_streaming_model(Path(model_dir), EngineConfig(prerouter="off", adapter="off", kernels="mlx"))
    try:
        spec, routers = streaming.spec, streaming.routers()
        if spec.prerouter_problem:
            raise ConfigError(f"{spec.model_type} cannot be driven by prerouter heads: {spec.prerouter_problem}")
        owners = eligible_owners(spec)
        heads = _new_heads(spec, routers, owners, width, streaming.embed_dim if token_input else 0)
        return save_heads(heads, out, base_identity=checkpoint_identity(model_dir),
                          recipe=dict(phase=0, steps=0, warm_start="next router", width=width, owners=owners),
                          training_data="none (warm start only)")
    finally:
        streaming.close()


def _new_heads(spec, routers, owners: list[int], width: int, token_dim: int = 0) -> PrerouterHeads:
    """Heads for ``owners``, each predicting its next MoE layer, warm-started from that
    layer's router."""
    from edge0.prerouter.heads import consumer_of

    consumers = [consumer_of(spec, o) for o in owners]
    heads = PrerouterHeads(owners, spec.hidden_size, _outputs(spec), spec.k, width, consumers, token_dim)
    heads.warm_start({c: bnn.router_weight(routers[c]) for c in consumers})
    return heads


def _outputs(spec) -> int:
    """The width of the routers' logits (the experts, plus zero experts where a model has them)."""
    return max(m.router_outputs for m in spec.layers.values())


def _cast(heads: PrerouterHeads, dtype) -> PrerouterHeads:
    copy = PrerouterHeads(heads.owners, heads.hidden, heads.experts, heads.k, heads.width, heads.consumers(),
                          heads.token_dim)
    bnn.load_parameters_flat(copy, {k: v.astype(dtype) for k, v in bnn.parameters_flat(heads).items()})
    return copy
