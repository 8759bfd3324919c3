"""Pipeline-parallel streaming: each rank of an ``mx.distributed`` group holds a contiguous
range of decoder layers and streams only their experts.

Every rank runs the same program (``mlx.launch``): the same prompts, the same sampling, the
same generation loop. What a rank holds: the resident weights of its layers (the embedding
on the first rank, the final norm and head on the last), its layers' expert ranges in its
own reader, scheduler and slots, and the prerouter heads whose consumer layer it holds.

What crosses, per forward pass, from rank r to rank r+1: the hidden state after r's last
layer and, when a head's owner layer is on r and its consumer on r+1, that owner's router
input and routed experts (the head's inputs cross with the activations; the head runs on
the consumer's rank, in its one flush at the start of the next step, so the consumer's
reads start before the activations arrive). At the start of each decode step, when a rank
after the first has heads that see the token, the first rank sends that token's embedding
row on (it alone holds the embedding). At the end of a pass the last rank's logits for the
last position are summed over the group with the others' zeros: every rank samples the same
token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from edge0.backend import core as B
from edge0.backend import dist as D
from edge0.backend import nn as bnn
from edge0.errors import ConfigError
from edge0.model.families import PIPELINE_MODEL_TYPES


FINAL_NORMS = ("norm", "final_layernorm", "norm_f", "ln_f", "final_norm")  # the final norm's names in mlx-lm


@dataclass(frozen=True)
class Schedule:
    """One iteration of a pipeline's batch loop, decided by rank 0 (``Pipeline.schedule``)."""

    stop: bool  # rank 0's engine closed: the ranks that follow stop
    admitted: int  # generations that join this iteration, in submission order
    cancelled: list[bool]  # per row already in the batch (joining, then decoding): cancelled on rank 0
    specs: list[dict] | None  # the admitted generations (Row.spec), when rank 0 leads a served pipeline
    micro: bool = False  # the batch decodes in two micro-batches until rank 0 says stop (Pipeline.control)


@dataclass(frozen=True)
class Layout:
    """``ranges[r]`` = (first, last + 1): rank r's decoder layers."""

    ranges: tuple[tuple[int, int], ...]
    rank: int

    @property
    def size(self) -> int:
        return len(self.ranges)

    def holds(self, layer: int, rank: int | None = None) -> bool:
        lo, hi = self.ranges[self.rank if rank is None else rank]
        return lo <= layer < hi

    def rank_of(self, layer: int) -> int:
        return next(r for r, (lo, hi) in enumerate(self.ranges) if lo <= layer < hi)

    def describe(self) -> str:
        return f"pipeline {self.size} ranks (layers " + " | ".join(f"{lo}-{hi - 1}" for lo, hi in self.ranges) + ")"


def parse_layers(text: str, num_layers: int, size: int) -> tuple[tuple[int, int], ...]:
    """``"0-3,4-7"`` -> ((0, 4), (4, 8)): one contiguous range per rank, together every layer."""
    ranges = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ConfigError(f"pipeline_layers {text!r}: each range is FIRST-LAST, e.g. 0-3,4-7") from None
        ranges.append((first, last + 1))
    if len(ranges) != size:
        raise ConfigError(f"pipeline_layers {text!r} names {len(ranges)} ranges for {size} ranks")
    expected = 0
    for first, end in ranges:
        if first != expected or end <= first:
            raise ConfigError(f"pipeline_layers {text!r}: the ranges must be contiguous, in order, from layer 0 "
                              f"(layer {expected} expected next)")
        expected = end
    if expected != num_layers:
        raise ConfigError(f"pipeline_layers {text!r} ends at layer {expected - 1}; the model has {num_layers} "
                          f"decoder layers (0-{num_layers - 1})")
    return tuple(ranges)


def balanced(layer_bytes: list[int], size: int) -> tuple[tuple[int, int], ...]:
    """Contiguous ranges, one per rank, each cut where the bytes so far come closest to an
    equal share (every rank at least one layer)."""
    n = len(layer_bytes)
    if size > n:
        raise ConfigError(f"{size} pipeline ranks for {n} decoder layers: at most one rank per layer")
    total, cuts, start = sum(layer_bytes), [], 0
    for r in range(1, size):
        goal = total * r / size
        best = None
        for i in range(start + 1, n - (size - r) + 1):
            so_far = sum(layer_bytes[:i])
            if best is None or abs(so_far - goal) < abs(best[1] - goal):
                best = (i, so_far)
        cuts.append(best[0])
        start = best[0]
    bounds = [0, *cuts, n]
    return tuple((bounds[i], bounds[i + 1]) for i in range(size))


def layer_bytes(index, spec) -> list[int]:
    """The checkpoint's bytes of each decoder layer (resident and experts)."""
    out = [0] * spec.num_layers
    for key, (_, entry) in index.entries.items():
        if key.startswith(spec.layer_prefix):
            head = key[len(spec.layer_prefix):].split(".", 1)[0]
            if head.isdigit() and int(head) < spec.num_layers:
                out[int(head)] += entry.nbytes
    return out


def resolve_layout(pipeline_layers: str | None, index, spec, group) -> Layout | None:
    """The layout of this process's group (None: one process)."""
    if group is None:
        if pipeline_layers:
            raise ConfigError("pipeline_layers applies under mlx.launch with more than one rank "
                              "(this process runs alone)")
        return None
    size = group.size()
    ranges = (parse_layers(pipeline_layers, spec.num_layers, size) if pipeline_layers
              else balanced(layer_bytes(index, spec), size))
    return Layout(ranges, group.rank())


@dataclass
class _ModelParts:
    """Where a model keeps what a pipeline splits (the names mlx-lm's model files give
    them): the decoder's inner module and its path, the final norm, the head, and the
    model's own caches (hybrid models' state-space or rotating caches beside KV caches),
    learnt before another rank's layers are replaced by stubs its make_cache cannot read."""

    model: object
    inner: object
    inner_path: str | None
    norm_name: str | None
    head_path: str
    caches: list | None

    @classmethod
    def of(cls, model, spec) -> "_ModelParts":
        inner_path = spec.layer_prefix[:-len(".layers.")] if spec.layer_prefix.endswith(".layers.") else None
        inner = bnn.module_at(model, inner_path) if inner_path else None
        outer = inner_path.rpartition(".")[0] if inner_path else ""
        norm_name = next((n for n in FINAL_NORMS if inner is not None and n in inner), None)
        head_path = f"{outer}.lm_head" if outer else "lm_head"
        missing = [what for what, there in (("decoder layers", inner is not None),
                                            ("embed_tokens", inner is not None and "embed_tokens" in inner),
                                            ("a final norm", norm_name is not None),
                                            ("an untied lm_head", bnn.module_at(model, head_path) is not None))
                   if not there]
        if missing:
            raise ConfigError(f"{spec.model_type}: pipeline parallelism needs the decoder layers, embed_tokens, a final "
                              f"norm and an untied lm_head where mlx-lm's model files keep them (no "
                              f"{', '.join(missing)})")
        return cls(model, inner, inner_path, norm_name, head_path,
                   model.make_cache() if hasattr(model, "make_cache") else None)


class Pipeline:
    """This rank's part of a pipeline over ``model`` (mlx-lm's, Edge0's stages in place)."""

    def __init__(self, layout: Layout, group, model, spec, heads=None):
        if spec.model_type not in PIPELINE_MODEL_TYPES:
            raise ConfigError(f"{spec.model_type}: pipeline parallelism is not available for this model type (its "
                              "two-rank text is not checked against one process's; the model types it is available "
                              "for are listed in the table of architectures, docs/MODELS.md)")
        self.layout, self.group, self.spec = layout, group, spec
        self.rank, self.size = layout.rank, layout.size
        self.parts = _ModelParts.of(model, spec)
        self.heads = heads
        self.crossing = self._crossing(heads)  # owner layer on this rank whose head's consumer is on the next
        self.incoming = self._incoming(heads)  # owner layer on the previous rank whose head runs here
        self.relay = heads is not None and heads.sees_token and any(
            self._rank_heads(heads, r) for r in range(1, self.size))
        self._captured: dict[str, object] = {}
        self._sent = None
        self.token_rows = None
        self.deferred = False  # the logits are summed by ``share``, not inside the forward pass (micro-batches)
        self._held: dict[str, object] = {}  # what ``prereceive`` received ahead of the pass that reads it

    # -- which heads run where --------------------------------------------------------------
    def _rank_heads(self, heads, rank: int) -> list[int]:
        return [o for o in heads.owners if self.layout.holds(heads.consumer[o], rank)]

    def local_owners(self, heads) -> list[int]:
        """The owners of the heads this rank runs: those whose consumer layer it holds."""
        owners = self._rank_heads(heads, self.rank)
        for o in owners:
            r = self.layout.rank_of(o)
            if r not in (self.rank, self.rank - 1):
                raise ConfigError(f"the head owned by layer {o} predicts layer {heads.consumer[o]}, two ranks on: "
                                  "choose pipeline_layers that keep each head within neighbouring ranks")
        return owners

    def _crossing(self, heads) -> int | None:
        if heads is None or self.rank == self.size - 1:
            return None
        out = [o for o in heads.owners if self.layout.holds(o) and self.layout.holds(heads.consumer[o], self.rank + 1)]
        return out[0] if out else None

    def _incoming(self, heads) -> int | None:
        if heads is None or self.rank == 0:
            return None
        out = [o for o in heads.owners if self.layout.holds(o, self.rank - 1) and self.layout.holds(heads.consumer[o])]
        return out[0] if out else None

    # -- what this rank holds ----------------------------------------------------------------
    def remote_key(self, key: str) -> bool:
        """Whether checkpoint tensor ``key`` belongs to another rank's part of the model."""
        prefix = self.spec.layer_prefix
        if key.startswith(prefix):
            head = key[len(prefix):].split(".", 1)[0]
            return head.isdigit() and not self.layout.holds(int(head))
        ip = self.parts.inner_path + "."
        if key.startswith(ip + "embed_tokens."):
            return self.rank != 0
        if key.startswith(ip + self.parts.norm_name + ".") or key.startswith(self.parts.head_path + "."):
            return self.rank != self.size - 1
        return False

    def remote_module(self, path: str) -> bool:
        return self.remote_key(path + ".")

    def strip(self, dtype) -> None:
        """Replace what this rank does not hold (before the resident weights load)."""
        vocab, embed_dim = bnn.module_at(self.parts.model, self.parts.head_path).weight.shape
        layers = self.parts.inner.layers
        lo, hi = self.layout.ranges[self.rank]
        for i in range(len(layers)):
            if not self.layout.holds(i):
                layers[i] = D.LayerStub(sent=(lambda: self._sent) if i >= hi else None, like=layers[i])
        self._dim = embed_dim
        if self.parts.caches is not None:  # make_cache reads the layers: it hands out fresh copies of what it made
            self.parts.model.make_cache = D.cache_maker(self.parts.caches)
        if self.rank != 0:
            self.parts.inner.embed_tokens = D.EmbedStub(embed_dim, dtype)
        if self.rank != self.size - 1:
            setattr(self.parts.inner, self.parts.norm_name, D.Identity())
            bnn.set_module_at(self.parts.model, self.parts.head_path, D.HeadStub(vocab, dtype, self.group, lambda: self._sent,
                                                                      shares=lambda: not self.deferred))

    def wire(self, streaming, prerouter) -> None:
        """After loading: the boundary layers send and receive, the last rank's head shares
        its logits, the crossing owner's inputs are captured, the relayed token rows are the
        local heads' embedding."""
        lo, hi = self.layout.ranges[self.rank]
        layers = self.parts.inner.layers
        if self.rank > 0:
            D.wrap_call(layers[lo], before=lambda x: self._receive(x, streaming, prerouter))
        if self.rank < self.size - 1:
            D.wrap_call(layers[hi - 1], after=self._send)
        else:
            D.head_that_shares(bnn.module_at(self.parts.model, self.parts.head_path), self.group, shares=lambda: not self.deferred)
        self._seeds = _shared_random(self.group)
        if self.crossing is not None:
            o = self.crossing
            streaming.routers()[o].watch = lambda layer, x, tap: self._captured.__setitem__("x", x)
            streaming.switches()[o].observer = lambda layer, inds: self._captured.__setitem__("inds", inds)

    def _send(self, out):
        parts = [out.astype(B.float32).reshape(-1)]
        if self.crossing is not None:
            parts += [self._captured["x"].astype(B.float32).reshape(-1),
                      self._captured["inds"].astype(B.float32).reshape(-1)]
        self._sent = D.send(B.concat(parts), self.rank + 1, self.group)
        return out

    def _receive(self, x, streaming, prerouter):
        rows = x.shape[0] * x.shape[1]
        n = x.size
        extra = rows * (self.spec.block_input + self.spec.k) if self.incoming is not None else 0
        buf = self._held.pop("hidden", None)
        if buf is None:
            buf = D.recv_like(B.zeros((n + extra,), dtype=B.float32), self.rank - 1, self.group)
        elif buf.size != n + extra:
            raise RuntimeError(f"received {buf.size} values ahead of a pass that reads {n + extra}")
        h = buf[:n].reshape(x.shape).astype(x.dtype)
        step = streaming.context.now
        if self.incoming is not None and prerouter is not None and step.heads is not None:
            width = rows * self.spec.block_input
            px = buf[n:n + width].reshape(rows, self.spec.block_input)
            inds = buf[n + width:].reshape(rows, self.spec.k).astype(B.int32)
            step.heads.observe(self.incoming, px, inds, step.decode)
        return h

    # -- per decode step -------------------------------------------------------------------
    def begin_step(self, inputs, embed) -> None:
        """The first rank sends the step's token embedding rows on; the others receive (and
        pass them on while a later rank needs them)."""
        if not self.relay:
            return
        if self.rank == 0:
            rows = embed(inputs).astype(B.float32)
            B.eval(D.send(rows, 1, self.group))
            self.token_rows = rows
            return
        rows = self._held.pop("token_rows", None)
        if rows is not None:  # received ahead (micro-batches)
            self.token_rows = rows
            return
        rows = D.recv_like(B.zeros((*inputs.shape, self.heads.token_dim), dtype=B.float32), self.rank - 1,
                           self.group)
        later = any(self._rank_heads(self.heads, r) for r in range(self.rank + 1, self.size))
        if later and self.rank < self.size - 1:
            B.eval(D.send(rows, self.rank + 1, self.group))
        B.eval(rows)
        self.token_rows = rows

    def relayed_embedding(self, dim: int):
        """ids -> the rows the first rank sent for this step (zeros of width ``dim`` before any)."""
        def embed(ids):
            rows = self.token_rows
            if rows is None or tuple(rows.shape[:-1]) != tuple(ids.shape):
                return B.zeros((*ids.shape, dim), dtype=B.float32)
            return rows
        return embed

    # -- micro-batches (two ranks): the order of transfers both ranks keep -------------------------
    def control(self, go: bool = False) -> bool:
        """Rank 0 tells rank 1 whether the next micro-batch turn runs (``go``); rank 1 learns
        it. A send, not a collective: rank 0 goes on computing while rank 1 still computes
        the turn before."""
        if self.rank == 0:
            B.eval(D.send(B.array([int(go)], dtype=B.int32), 1, self.group))
            return go
        return bool(B.to_host(D.recv_like(B.zeros((1,), dtype=B.int32), 0, self.group))[0])

    def prereceive(self, rows: int) -> None:
        """Rank 1: receive the coming decode pass's transfers now (the token rows the heads
        see, then the hidden state and a crossing head's inputs), before the sum of the turn
        before, in the order rank 0 sent them; the pass reads them from here."""
        if self.rank == 0:
            return
        if self.relay:
            held = D.recv_like(B.zeros((rows, 1, self.heads.token_dim), dtype=B.float32), 0, self.group)
            B.eval(held)
            self._held["token_rows"] = held
        extra = rows * (self.spec.block_input + self.spec.k) if self.incoming is not None else 0
        held = D.recv_like(B.zeros((rows * self._dim + extra,), dtype=B.float32), 0, self.group)
        B.eval(held)
        self._held["hidden"] = held

    def drop_held(self) -> None:
        """Forget what ``prereceive`` received that no pass read."""
        self._held.clear()

    def share(self, logits):
        """A deferred pass's last-position logits summed over the group (every rank's the
        same after)."""
        return D.all_sum(logits, self.group)

    # -- the batch loop's schedule: rank 0 decides, the others follow ---------------------------
    leading = False  # rank 0 of a served pipeline: the generations it admits start on the other ranks too

    def schedule(self, cancelled: list[bool] = (), admitted: int = 0, specs: list[dict] | None = None,
                 stop: bool = False, micro: bool = False) -> "Schedule":
        """One iteration of the batch loop, as rank 0 runs it, on every rank: how many
        generations it admits (with their ``specs`` when it leads a served pipeline), which of
        the rows already in the batch were cancelled there (in the batch's order), or ``stop``
        (a leading rank 0 closed: stop following). The other ranks pass nothing; what they
        pass is ignored. ``micro``: this iteration's decode runs in micro-batches. One ``all_sum``
        of five words, one more when there are flags or specs."""
        lead = self.rank == 0
        payload = json.dumps(specs).encode() if lead and specs else b""
        head = [int(stop), admitted, len(cancelled), len(payload), int(micro)] if lead else [0, 0, 0, 0, 0]
        stop_, n, flags, size, micro_ = (int(v) for v in B.to_host(D.all_sum(B.array(head, dtype=B.int32),
                                                                               self.group)))
        if flags + size == 0:
            return Schedule(bool(stop_), n, [], None, bool(micro_))
        buf = np.zeros(flags + size, dtype=np.int32)
        if lead:
            buf[:flags] = [int(bool(c)) for c in cancelled]
            buf[flags:] = np.frombuffer(payload, dtype=np.uint8)
        total = np.asarray(B.to_host(D.all_sum(B.array(buf), self.group)))
        given = json.loads(bytes(total[flags:].astype(np.uint8)).decode()) if size else None
        return Schedule(bool(stop_), n, [bool(v) for v in total[:flags]], given, bool(micro_))

    def next_seed(self) -> int:
        """A generation's seed when it names none: random, and the same on every rank."""
        return self._seeds.getrandbits(63)

    def gather(self, values: list[int]) -> list[list[int]]:
        """Each rank's ``values`` (non-negative integers, the same count on every rank), rank
        by rank, exactly (each sent as two int32 words of 20 bits and the rest)."""
        n = len(values)
        words = np.zeros((self.size, n, 2), dtype=np.int32)
        for i, v in enumerate(values):
            words[self.rank, i] = (int(v) >> 20, int(v) & 0xFFFFF)
        total = np.asarray(B.to_host(D.all_sum(B.array(words), self.group))).astype(np.int64)
        return [[int(hi << 20 | lo) for hi, lo in total[r]] for r in range(self.size)]


def _shared_random(group):
    """A random generator seeded alike on every rank (the first rank's draw)."""
    import os
    import random

    mine = [int.from_bytes(os.urandom(3), "little") for _ in range(3)] if group.rank() == 0 else [0, 0, 0]
    words = B.to_host(D.all_sum(B.array(mine, dtype=B.int32), group)).tolist()
    return random.Random(sum(int(w) << (24 * i) for i, w in enumerate(words)))


def pipeline_part(config, model, spec, index, heads):
    """(this rank's Pipeline or None, the config with its layer paths on this rank's layers,
    the heads this rank runs) under ``mlx.launch``; (None, config, heads) alone."""
    from dataclasses import replace

    group = D.group() if config.pipeline == "auto" else None
    layout = resolve_layout(config.pipeline_layers, index, spec, group)
    if layout is None:
        return None, config, heads
    if config.pipeline_micro_batches == 2 and layout.size != 2:
        raise ConfigError(f"pipeline_micro_batches 2 applies to a pipeline of two ranks (this one has {layout.size}); "
                          "use pipeline_micro_batches 1")
    pipe = Pipeline(layout, group, model, spec, heads)
    config = replace(config, layer_paths=tuple(e for e in config.layer_paths if layout.holds(e[0])))
    if heads is not None:
        owners = pipe.local_owners(heads)
        heads = heads.subset(owners) if owners else None
    return pipe, config, heads
