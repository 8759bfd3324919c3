"""Recovery LoRA adapters, served unmerged beside the int4 base.

An adapter adds ``scale * (x @ A) @ B`` to the output of an attention, linear-attention or
shared-expert projection: ``y = base(x) + scale * (x @ A) @ B``. The base's int4 bytes are
never touched, the routed experts (which stream from disk) and the routers never carry an
adapter, and several adapters can stay resident on one base: each generation picks one.

Files use mlx-lm's adapter layout, so adapters move both ways between Edge0 and
``mlx_lm.load(path, adapter_path=...)``: a directory holding ``adapters.safetensors``
(tensors ``<module path>.lora_a`` [in, r] and ``.lora_b`` [r, out]) and
``adapter_config.json`` (``fine_tune_type``, ``num_layers``, ``lora_parameters`` with
``rank``, ``scale``, ``dropout``, ``keys``). Edge0 writes provenance into the safetensors
metadata (format ``edge0-adapter/1``): the base checkpoint's identity, the identity and
routing width of the prerouter heads it was trained under, phase, recipe, data, creation
time, version. An adapter whose provenance names another base, or other heads than the
ones the engine serves with, is refused naming both identities; one without provenance
(trained by ``mlx_lm.lora``) is checked by its shapes alone.

The computation matches mlx-lm's ``LoRALinear`` op for op, so the logits agree with
mlx-lm's when both route the same way.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.errors import CheckpointError, ConfigError, ForeignArtifactError
from edge0.model.files import atomic_write, check_entry, parse_json, read_bytes
from edge0.model.safetensors_header import read_header
from edge0.model.spec import MoESpec
from edge0.prerouter.files import heads_identities
from edge0.exec.taps import AdaptedLinear, AdapterBank

ADAPTER_DIRNAME = "adapter"  # discovered beside the checkpoint, like prerouter.safetensors
WEIGHTS_FILE = "adapters.safetensors"
CONFIG_FILE = "adapter_config.json"
FORMAT = "edge0-adapter/1"
MAX_RANK = 4096
# Attention-like children of a decoder layer (full, linear and MLA attention, Mamba mixers).
ATTENTION_ATTRS = ("self_attn", "attention", "linear_attn", "attn", "mixer")



def artifact_identity(path: str | Path) -> str:
    """A file's identity for provenance: the hash of its safetensors header (tensor names,
    shapes, offsets and metadata), cheap to compute and changed by any retraining."""
    return read_header(path).digest[:32]


def target_modules(model, spec: MoESpec) -> dict[str, object]:
    """Every projection an adapter may wrap: linear layers inside a decoder layer's
    attention (or linear-attention / state-space mixer), and inside its MoE block's shared
    expert. Never a routed expert, a router, a gate of the shared expert (a one-output
    linear), a dense MLP, an embedding or the head."""
    prefix = spec.layer_prefix
    out = {}
    for path, module in bnn.linear_modules(model):
        if path.endswith(".linear") and isinstance(bnn.module_at(model, path[: -len(".linear")]), AdaptedLinear):
            path = path[: -len(".linear")]  # already wrapped by another adapter: the projection itself
        if not path.startswith(prefix):
            continue
        index, _, rel = path[len(prefix):].partition(".")
        if not index.isdigit():
            continue
        if rel.split(".")[0] in ATTENTION_ATTRS:
            out[path] = module
            continue
        moe = spec.layers.get(int(index))
        if moe is None or not path.startswith(moe.block_path + ".") or path == moe.router_path:
            continue
        inner = path[len(moe.block_path) + 1:].split(".")
        if len(inner) >= 2 and inner[0].startswith(("shared", "share_")) and bnn.linear_dims(module)[0] > 1:
            out[path] = module
    return out


def adapter_key(spec: MoESpec, path: str) -> str:
    """A target's path inside its decoder layer (mlx-lm's ``lora_parameters.keys``)."""
    return path[len(spec.layer_prefix):].split(".", 1)[1]


@dataclass
class Adapter:
    """One adapter, loaded and checked, ready to be attached."""

    name: str
    path: Path
    rank: int
    scale: float
    tensors: dict[str, tuple[object, object]]  # module path -> (lora_a [in, r], lora_b [r, out])
    config: dict
    meta: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.tensors.values())

    def describe(self) -> str:
        phase = self.meta.get("phase")
        return (f"{self.name} (rank {self.rank}, {len(self.tensors)} projections"
                + (f", phase {phase}" if phase else "") + ")")


def _lora_config(adapter_dir: Path) -> dict:
    try:
        raw = read_bytes(adapter_dir, CONFIG_FILE, 1 << 20)
    except FileNotFoundError:
        raise ConfigError(f"{adapter_dir} is not an adapter directory: {CONFIG_FILE} does not exist") from None
    cfg = parse_json(raw, adapter_dir / CONFIG_FILE)
    if not isinstance(cfg, dict):
        raise ConfigError(f"{adapter_dir / CONFIG_FILE} must hold a JSON object")
    kind = cfg.get("fine_tune_type", "lora")
    if kind != "lora":
        raise ConfigError(f"{adapter_dir / CONFIG_FILE}: fine_tune_type {_show(kind)} is not supported (only 'lora': a "
                          "DoRA or full fine-tune changes the base weights, which Edge0 never does)")
    lp = cfg.get("lora_parameters")
    if not isinstance(lp, dict):
        raise ConfigError(f"{adapter_dir / CONFIG_FILE}: 'lora_parameters' must be an object")
    rank, scale = lp.get("rank"), lp.get("scale")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise ConfigError(f"{adapter_dir / CONFIG_FILE}: lora_parameters.rank must be an integer in 1..{MAX_RANK}, "
                          f"got {_show(rank)}")
    if not _finite(scale):
        raise ConfigError(f"{adapter_dir / CONFIG_FILE}: lora_parameters.scale must be a finite number, got "
                          f"{_show(scale)}")
    return cfg


def _finite(value) -> bool:
    """A number (not a bool) that converts to a finite float (10**400 does not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def _weights_file(adapter_dir: Path) -> Path:
    try:
        return check_entry(adapter_dir, WEIGHTS_FILE)
    except FileNotFoundError:
        raise CheckpointError(f"does not exist (an adapter directory holds {WEIGHTS_FILE} and {CONFIG_FILE})",
                              file=adapter_dir / WEIGHTS_FILE) from None


def load_adapter(adapter_dir: str | Path, model, spec: MoESpec, *, base_identity: str,
                 heads_ids: tuple[str, ...] | None, name: str | None = None, held=None) -> Adapter:
    """Read and check an adapter directory against the loaded model; nothing is attached.
    ``held(module)``: whether this process holds that module (a pipeline rank holds its
    layers' only); the adapter's tensors for the others are left to their ranks."""
    adapter_dir = Path(adapter_dir)
    cfg = _lora_config(adapter_dir)
    weights = _weights_file(adapter_dir)
    header = read_header(weights)  # typed errors for malformed files, before any data is read
    meta = dict(header.metadata)
    _check_provenance(meta, weights, base_identity, heads_ids)
    targets = target_modules(model, spec)
    by_module: dict[str, dict] = {}
    for key, entry in header.tensors.items():
        module, _, leaf = key.rpartition(".")
        if held is not None and not held(module):
            continue
        if leaf not in ("lora_a", "lora_b"):
            raise CheckpointError("not a LoRA tensor (expected <module>.lora_a / .lora_b); Edge0 serves LoRA "
                                  "adapters only", file=weights, tensor=key)
        if module not in targets:
            why = ("a routed expert streams from disk and never carries an adapter" if ".switch_mlp." in module
                   else "not an attention or shared-expert projection of this model")
            raise CheckpointError(f"module {module!r}: {why}", file=weights, tensor=key)
        if entry.dtype not in ("F32", "F16", "BF16"):
            raise CheckpointError(f"dtype {entry.dtype}, expected a float type", file=weights, tensor=key)
        by_module.setdefault(module, {})[leaf] = entry
    if not by_module:
        raise CheckpointError("the adapter holds no LoRA tensor", file=weights)
    rank = cfg["lora_parameters"]["rank"]
    for module, parts in by_module.items():
        if set(parts) != {"lora_a", "lora_b"}:
            raise CheckpointError(f"module {module!r} has {sorted(parts)} but needs both lora_a and lora_b",
                                  file=weights)
        out_dim, in_dim = bnn.linear_dims(targets[module])
        want = {"lora_a": (in_dim, rank), "lora_b": (rank, out_dim)}
        for leaf, entry in parts.items():
            if tuple(entry.shape) != want[leaf]:
                raise CheckpointError(f"shape {list(entry.shape)}, expected {list(want[leaf])} (rank {rank}, "
                                      f"projection {out_dim}x{in_dim})", file=weights, tensor=f"{module}.{leaf}")
    arrays, _ = B.load_safetensors(str(weights))
    tensors = {m: (arrays[f"{m}.lora_a"], arrays[f"{m}.lora_b"]) for m in by_module}
    B.eval([t for pair in tensors.values() for t in pair])
    return Adapter(name or adapter_dir.name, adapter_dir, rank, float(cfg["lora_parameters"]["scale"]), tensors,
                   cfg, meta)


def _check_provenance(meta: dict, path: Path, base_identity: str, heads_ids: tuple[str, ...] | None) -> None:
    if meta.get("format") != FORMAT:
        return  # not made by Edge0 (e.g. mlx_lm.lora): shapes are all there is to check
    if meta.get("base_identity") != base_identity:
        raise ForeignArtifactError(
            f"the adapter was made for another base checkpoint: its base_identity is "
            f"{_show(meta.get('base_identity'))}, this model is {base_identity!r}", file=path)
    trained_heads = meta.get("heads_identity") or None
    if trained_heads and heads_ids and trained_heads not in heads_ids:
        raise ForeignArtifactError(
            f"the adapter was trained under other prerouter heads: its heads_identity is {_show(trained_heads)}, this "
            f"engine serves with heads {heads_ids[0]!r} (retrain the adapter, or serve it with its heads)",
            file=path)


def save_adapter(tensors: dict[str, tuple[object, object]], out_dir: str | Path, *, rank: int, scale: float,
                 keys: list[str], num_layers: int, provenance: dict, dropout: float = 0.0) -> Path:
    """Write an adapter directory in mlx-lm's layout, with Edge0's provenance in the
    safetensors metadata; each file through a temp file, fsync and rename."""
    from edge0 import __version__

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for module, (a, b) in tensors.items():
        arrays[f"{module}.lora_a"], arrays[f"{module}.lora_b"] = a, b
    meta = {"format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "edge0_version": __version__}
    meta.update({k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in provenance.items()})
    atomic_write(out / WEIGHTS_FILE, lambda tmp: B.save_safetensors(tmp, arrays, meta))
    config = {"fine_tune_type": "lora", "num_layers": num_layers,
              "lora_parameters": {"rank": rank, "scale": scale, "dropout": dropout, "keys": sorted(keys)}}
    atomic_write(out / CONFIG_FILE, lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2) + "\n"))
    return out


def adapter_dirs(model_dir: Path, config) -> list[tuple[str, Path]]:
    """(name, directory) of the adapters to load: the default one first."""
    out = []
    if config.adapter == "auto":
        beside = model_dir / ADAPTER_DIRNAME
        if beside.is_dir() and not beside.is_symlink():
            out.append((ADAPTER_DIRNAME, beside))
    elif config.adapter != "off":
        d = Path(config.adapter)
        if not d.is_dir():
            raise ConfigError(f"adapter {d} is not a directory (an adapter is a directory with "
                              "adapters.safetensors and adapter_config.json)")
        out.append((d.name, d))
    for extra in config.extra_adapters:
        d = Path(extra)
        if not d.is_dir():
            raise ConfigError(f"adapter {d} is not a directory")
        out.append((d.name, d))
    return out


def load_adapters(model_dir: Path, config, model, spec, heads_path, log, held=None,
                  context=None) -> "AdapterBank | None":
    """The adapters ``config`` names (or the one beside the checkpoint), checked against
    the loaded model and attached, the default one active; ``held``: see ``load_adapter``."""
    dirs = adapter_dirs(model_dir, config)
    if not dirs:
        return None
    bank = AdapterBank(model, spec, context)
    from edge0.prerouter.files import checkpoint_identity

    base = checkpoint_identity(model_dir)
    heads_ids = heads_identities(heads_path) if heads_path is not None else None
    for name, d in dirs:
        adapter = load_adapter(d, model, spec, base_identity=base, heads_ids=heads_ids, name=name, held=held)
        if log is not None and adapter.meta.get("heads_identity") and heads_ids is None:
            log.warning("adapter.without_heads", adapter=name,
                        detail="trained under prerouter heads that this engine does not use")
        bank.add(adapter)
    bank.activate(dirs[0][0] if config.adapter != "off" else None)
    return bank
