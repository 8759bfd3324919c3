"""Heads files: safetensors beside the checkpoint, with provenance; never merged.

Metadata (all strings): format, base_identity (the checkpoint the heads were trained on:
a hash of config.json and every weight file's name, size and header), owners, shape,
inputs (what each head sees, JSON; files without it see hidden state and the two routing
one-hots), serving (JSON, optional: the routing mode and staged extras the heads were
chosen for, the engine's default when its config says "auto"; inside it, optionally,
``over_memory``: the routing for where the checkpoint is larger than the memory the
process may use), recipe and
hyperparameters (JSON), training data description, creation time, edge0 version. A file
whose base identity differs from the model's is refused.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from pathlib import Path

from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.errors import CheckpointError, ConfigError, ForeignArtifactError
from edge0.model.files import atomic_write, rewrite_metadata
from edge0.prerouter.heads import BASE_INPUTS, KNOWN_INPUTS, PrerouterHeads
from edge0.model.safetensors_header import read_header

HEADS_FILENAME = "prerouter.safetensors"
FORMAT = "edge0-prerouter/1"
STORED_DTYPE = "F16"  # what save_heads writes


def checkpoint_identity(model_dir: str | Path) -> str:
    """A stable identity of a checkpoint from its config and weight-file headers (cheap:
    no tensor data is read)."""
    d = Path(model_dir)
    h = hashlib.sha256((d / "config.json").read_bytes())
    for f in sorted(d.glob("model*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            h.update(f.name.encode() + str(f.stat().st_size).encode() + fh.read(n))
    return h.hexdigest()[:32]


ROUTING_MODES = ("replace", "select")


def heads_identity(path: str | Path) -> str:
    """A heads file's identity for provenance: the hash of its header with the ``serving``
    record left out. That record says how the heads are best served, not what they are: a
    changed recommendation keeps the adapters trained under the heads."""
    return _identity(read_header(path))


def heads_identities(path: str | Path) -> tuple[str, str]:
    """What an adapter may record as the heads it was trained under: ``heads_identity``, or
    the whole header's hash (``edge0.adapters.artifact_identity``) that adapters made before
    recorded."""
    header = read_header(path)
    return _identity(header), header.digest[:32]


def _identity(header) -> str:
    tensors = {name: [e.dtype, list(e.shape), e.begin, e.end] for name, e in header.tensors.items()}
    metadata = {k: v for k, v in header.metadata.items() if k != "serving"}
    text = json.dumps({"tensors": tensors, "metadata": metadata}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def save_heads(heads: PrerouterHeads, path: str | Path, *, base_identity: str, recipe: dict,
               training_data: str, serving: dict | None = None) -> Path:
    """Write fp16 heads with provenance; temp file, fsync, rename. ``serving``: the routing
    they are meant to be served with, e.g. {"routing": "select", "stage_extra": 8}."""
    from edge0 import __version__

    path = Path(path)
    arrays = {k: v.astype(B.float16) for k, v in bnn.parameters_flat(heads).items()}  # STORED_DTYPE
    meta = {
        "format": FORMAT, "base_identity": base_identity, "owners": json.dumps(heads.owners),
        "consumers": json.dumps(heads.consumers()),
        "shape": json.dumps({"hidden": heads.hidden, "experts": heads.experts, "k": heads.k, "width": heads.width,
                             "token_dim": heads.token_dim}),
        "inputs": json.dumps(list(heads.inputs)),
        "recipe": json.dumps(recipe, sort_keys=True), "training_data": training_data,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "edge0_version": __version__,
    }
    if serving is not None:
        meta["serving"] = json.dumps(_checked_serving(serving, path), sort_keys=True)
    atomic_write(path, lambda tmp: B.save_safetensors(tmp, arrays, meta))
    return path


def serving_of(meta: dict, path: Path | None = None) -> dict:
    """The routing a heads file recommends: {"routing": "replace", "stage_extra": 0} when it
    says nothing (files written before there was a choice). An ``over_memory`` record
    inside it, when present, is the routing recommended where the checkpoint's files are
    larger than the memory the process may use."""
    if "serving" not in meta:
        return {"routing": "replace", "stage_extra": 0}
    try:
        value = json.loads(meta["serving"])
    except (ValueError, RecursionError):
        raise CheckpointError("heads metadata 'serving' is not valid JSON", file=path) from None
    return _checked_serving(value, path)


def _checked_serving(value, path, *, inner: bool = False) -> dict:
    name = "serving.over_memory" if inner else "serving"
    if not isinstance(value, dict) or value.get("routing") not in ROUTING_MODES:
        raise CheckpointError(f"heads metadata '{name}' must be {{\"routing\": one of {ROUTING_MODES}, "
                              f"\"stage_extra\": N}}, got {value!r:.80}", file=path)
    extra = value.get("stage_extra", 0)
    if isinstance(extra, bool) or not isinstance(extra, int) or not 0 <= extra < 1 << 16:
        raise CheckpointError(f"heads metadata {name}.stage_extra must be a non-negative integer, got "
                              f"{extra!r:.40}", file=path)
    out = {"routing": value["routing"], "stage_extra": extra}
    if "over_memory" in value:
        if inner:
            raise CheckpointError("heads metadata serving.over_memory cannot hold another over_memory", file=path)
        out["over_memory"] = _checked_serving(value["over_memory"], path, inner=True)
    return out


def parse_routing(text: str) -> dict:
    """``replace``, or ``select:M`` (select routing staging M experts beyond k), as a serving
    record: the form ``--over-memory`` takes."""
    mode, _, extra = str(text).partition(":")
    if mode == "replace" and not extra:
        return {"routing": "replace", "stage_extra": 0}
    if mode == "select" and extra.isdigit():
        return {"routing": "select", "stage_extra": int(extra)}
    raise ConfigError(f"a routing is 'replace' or 'select:M' (M experts staged beyond k, e.g. select:0), "
                      f"got {text!r}")


def set_serving(path: str | Path, serving: dict, adapters=()) -> list[Path]:
    """Rewrite a heads file's ``serving`` record (the routing it recommends), every tensor
    byte and every other field as they were; temp file, fsync, rename. The heads' identity
    for adapters (``heads_identity``) leaves this record out, so adapters that recorded it
    still load; of the ``adapters`` weights files given, those that recorded the whole
    header's hash (adapters made before) are re-recorded with ``heads_identity``, which
    the new header keeps. Returns those re-recorded."""
    path = Path(path)
    header = read_header(path)
    if header.metadata.get("format") != FORMAT:
        raise CheckpointError(f"not an Edge0 prerouter heads file "
                              f"(format {_short(repr(header.metadata.get('format')))})", file=path)
    record = json.dumps(_checked_serving(serving, path), sort_keys=True)
    legacy, ident = header.digest[:32], _identity(header)
    stale = [Path(a) for a in adapters if read_header(a).metadata.get("heads_identity") == legacy]
    rewrite_metadata(path, {"serving": record})
    for weights in stale:
        rewrite_metadata(weights, {"heads_identity": ident})
    return stale


def load_heads(path: str | Path, model_dir: str | Path, *, dtype: str = "float16",
               spec=None) -> tuple[PrerouterHeads, dict]:
    """Load heads for the checkpoint in ``model_dir``; refuses malformed or foreign files,
    and (given the model's ``spec``) heads whose experts, hidden size, k or owner layers
    are not the model's."""
    path = Path(path)
    header = read_header(path)  # typed errors for malformed files, before any data is read
    meta = header.metadata
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"not an Edge0 prerouter heads file (format {_short(repr(meta.get('format')))}, "
                              f"expected {FORMAT!r})", file=path)
    expected = checkpoint_identity(model_dir)
    if meta.get("base_identity") != expected:
        raise ForeignArtifactError(
            f"heads were made for another base checkpoint: base_identity {_short(repr(meta.get('base_identity')))}, "
            f"this model ({model_dir}) is {expected!r}; retrain with `edge0 train heads`", file=path)
    owners, shape, consumers = _heads_shape(meta, path)
    serving_of(meta, path)
    if spec is not None:
        _check_against_model(owners, consumers, shape, spec, path)
    _check_tensors(header, owners, consumers, shape, path)
    heads = PrerouterHeads(owners, shape["hidden"], shape["experts"], shape["k"], shape["width"], consumers,
                           token_dim=shape["token_dim"])
    arrays, _ = B.load_safetensors(str(path))
    bnn.load_parameters_flat(heads, {k: v.astype(B.dtype(dtype)) for k, v in arrays.items()})
    return heads, dict(meta)


def _check_tensors(header, owners: list[int], consumers: list[int], shape: dict, path: Path) -> None:
    """The header's tensors are the metadata's heads' parameters, names, shapes and dtype,
    checked before those heads are built: the metadata alone may name 100,000 owners, and
    building their heads costs gigabytes whatever the file holds. One head is built to
    learn a head's parameters (lazily: nothing is allocated)."""
    for name, entry in header.tensors.items():
        if entry.dtype != STORED_DTYPE:  # a relabelled tensor would load as other numbers
            raise CheckpointError(f"dtype {entry.dtype}: heads files store every tensor as {STORED_DTYPE}",
                                  file=path, tensor=name)
    one = PrerouterHeads(owners[:1], shape["hidden"], shape["experts"], shape["k"], shape["width"], consumers[:1],
                         token_dim=shape["token_dim"])
    prefix = f"heads.layer{owners[0]}."
    per_head = {name[len(prefix):]: tuple(a.shape) for name, a in bnn.parameters_flat(one).items()}
    if len(header.tensors) != len(owners) * len(per_head):
        raise CheckpointError(f"heads tensors differ from the metadata's shape: its {len(owners)} owners' heads have "
                              f"{len(owners) * len(per_head)} tensors, the file holds {len(header.tensors)}", file=path)
    want = {f"heads.layer{o}.{p}": s for o in owners for p, s in per_head.items()}
    if set(header.tensors) != set(want):
        missing, extra = sorted(set(want) - set(header.tensors)), sorted(set(header.tensors) - set(want))
        raise CheckpointError(f"heads tensors differ from the metadata's shape: missing {missing[:4]}, "
                              f"unexpected {[_short(x) for x in extra[:4]]}", file=path)
    for name, entry in header.tensors.items():
        if entry.shape != want[name]:
            raise CheckpointError(f"shape {list(entry.shape)}, expected {list(want[name])}", file=path, tensor=name)


def _short(text) -> str:
    """A value from a hostile file, short enough for a one-line message."""
    text = str(text)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _heads_shape(meta: dict, path: Path) -> tuple[list[int], dict, list[int]]:
    """owners, shape and consumers from the metadata, each value checked for type and range
    (files without ``consumers`` predict the layer after each owner)."""
    try:
        owners = json.loads(meta["owners"])
        shape = json.loads(meta["shape"])
    except (KeyError, ValueError, RecursionError):
        raise CheckpointError("heads metadata lacks valid 'owners'/'shape' JSON", file=path) from None
    if not isinstance(owners, list) or not owners or not all(
            isinstance(o, int) and not isinstance(o, bool) and 0 <= o < 100_000 for o in owners) \
            or len(set(owners)) != len(owners):
        raise CheckpointError(f"heads metadata 'owners' must be a list of distinct layer numbers, got {owners!r:.80}",
                              file=path)
    try:
        consumers = json.loads(meta["consumers"]) if "consumers" in meta else [o + 1 for o in owners]
    except (ValueError, RecursionError):
        raise CheckpointError("heads metadata 'consumers' is not valid JSON", file=path) from None
    if not isinstance(consumers, list) or len(consumers) != len(owners) or not all(
            isinstance(c, int) and not isinstance(c, bool) and o < c < 100_000 for o, c in zip(owners, consumers)):
        raise CheckpointError(f"heads metadata 'consumers' must list one later layer per owner, got "
                              f"{consumers!r:.80}", file=path)
    if not isinstance(shape, dict):
        raise CheckpointError("heads metadata 'shape' must be an object", file=path)
    for key, top in (("hidden", 1 << 20), ("experts", 1 << 16), ("k", 1 << 16), ("width", 1 << 16)):
        v = shape.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top:
            raise CheckpointError(f"heads metadata shape.{key} must be an integer in 1..{top}, got {v!r:.40}",
                                  file=path)
    try:
        inputs = tuple(json.loads(meta["inputs"])) if "inputs" in meta else BASE_INPUTS
    except (TypeError, ValueError, RecursionError):
        raise CheckpointError("heads metadata 'inputs' is not a JSON list", file=path) from None
    if inputs not in KNOWN_INPUTS:
        raise CheckpointError(f"heads metadata 'inputs' {list(inputs)!r:.120} is none of the known input sets "
                              f"{[list(i) for i in KNOWN_INPUTS]}", file=path)
    token_dim = shape.get("token_dim", 0)
    if isinstance(token_dim, bool) or not isinstance(token_dim, int) or not 0 <= token_dim <= 1 << 20 \
            or (token_dim > 0) != ("token" in inputs):
        raise CheckpointError(f"heads metadata shape.token_dim ({token_dim!r:.40}) does not fit inputs "
                              f"{list(inputs)}", file=path)
    shape = dict(shape, token_dim=token_dim)
    return owners, shape, consumers


def _check_against_model(owners: list[int], consumers: list[int], shape: dict, spec, path: Path) -> None:
    from edge0.prerouter.heads import consumer_of, eligible_owners

    if spec.prerouter_problem:
        raise CheckpointError(f"{spec.model_type} cannot be driven by prerouter heads: {spec.prerouter_problem}",
                              file=path)
    outputs = max(m.router_outputs for m in spec.layers.values())
    for key, want in (("experts", outputs), ("hidden", spec.hidden_size), ("k", spec.k)):
        if shape[key] != want:
            raise CheckpointError(f"heads predict for {key} = {shape[key]}, the model has {want}", file=path)
    eligible = eligible_owners(spec)
    bad = [o for o in owners if o not in eligible]
    if bad:
        raise CheckpointError(f"heads owned by layers {_short(bad)} cannot serve this model: a head's owner must be "
                              f"a MoE layer followed by another (eligible owners {eligible})", file=path)
    wrong = [(o, c) for o, c in zip(owners, consumers) if consumer_of(spec, o) != c]
    if wrong:
        raise CheckpointError(f"heads predict layers {_short([c for _, c in wrong])} from owners "
                              f"{_short([o for o, _ in wrong])}; in this model those owners' next MoE layers are "
                              f"{_short([consumer_of(spec, o) for o, _ in wrong])}", file=path)
