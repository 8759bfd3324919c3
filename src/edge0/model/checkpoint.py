"""The checkpoint index: every routed expert's byte ranges, validated up front.

Opening a model directory reads only the safetensors headers (``safetensors_header``),
checks them against config.json (``MoESpec``) and maps each (layer, expert) to the byte
ranges of its gate/up/down x weight/scales/biases rows in the (possibly sharded) files.
Any inconsistency is a typed error naming the file and tensor before a data byte is read.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from edge0.errors import LayoutError, UnsafeModelError
from edge0.model.files import check_directory, check_entry, read_json
from edge0.model.safetensors_header import SafetensorsHeader, TensorEntry, read_header
from edge0.model.spec import MoESpec

# Files that would make a loader execute code or unpickle data.
_UNSAFE_SUFFIXES = (".py", ".pyc", ".pkl", ".pickle", ".bin", ".pt", ".pth", ".ckpt")
_SCALE_DTYPES = ("BF16", "F16", "F32")


@dataclass(frozen=True)
class TensorLocation:
    """Where one stacked expert tensor lives: expert e is ``row_bytes`` at ``offset + e*row_bytes``."""

    key: str
    file: str
    dtype: str
    offset: int  # absolute file offset of expert 0
    row_bytes: int  # bytes of one expert
    row_shape: tuple[int, ...]  # shape of one expert's slice

    def expert_range(self, expert: int) -> tuple[int, int]:
        start = self.offset + expert * self.row_bytes
        return start, start + self.row_bytes


@dataclass(frozen=True)
class LayerExperts:
    """The stacked tensors of one MoE layer's experts, in the switch module's parameter
    order (``gate_proj.weight``, ``gate_proj.scales``, ...): expert e is one row of each."""

    layer: int
    names: tuple[str, ...]  # parameter names inside the switch module
    tensors: tuple[TensorLocation, ...]

    def location(self, name: str) -> TensorLocation:
        return self.tensors[self.names.index(name)]

    @property
    def expert_bytes(self) -> int:
        return sum(t.row_bytes for t in self.tensors)

    @cached_property
    def layout(self) -> tuple:
        """What two layers must share to use the same row buffers."""
        return tuple((n, t.dtype, t.row_shape, t.row_bytes) for n, t in zip(self.names, self.tensors))


def refuse_unsafe(model_dir: Path, config: dict) -> None:
    """Refuse directories that ask to run code or hold pickles, and entries that are not
    regular files inside the directory (FIFOs, devices, links leaving it): nothing is
    executed, nothing outside the directory is read."""
    if config.get("model_file") is not None:
        raise UnsafeModelError(
            f"config.json asks to import custom code (model_file={config['model_file']!r}); refused",
            file=model_dir / "config.json",
        )
    for path in sorted(model_dir.iterdir()):
        if path.suffix in _UNSAFE_SUFFIXES and not path.is_dir():
            raise UnsafeModelError(
                f"model directory holds {path.name!r}: code and pickle files are refused "
                "(Edge0 loads safetensors and JSON only)", file=path,
            )
    check_directory(model_dir)


_SHARD_NAME = re.compile(r"model[A-Za-z0-9._-]*\.safetensors")
MAX_WEIGHT_FILES = 4096  # the largest public checkpoints have a few hundred shards


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files, each a regular file inside the directory; the shard
    index, when present, may only name such files."""
    files = sorted(p for p in model_dir.glob("model*.safetensors") if _SHARD_NAME.fullmatch(p.name))
    if not files:
        raise LayoutError("no model*.safetensors file in the model directory", file=model_dir)
    if len(files) > MAX_WEIGHT_FILES:
        raise LayoutError(f"{len(files)} weight files (model*.safetensors): more than the {MAX_WEIGHT_FILES} "
                          "Edge0 opens; write the checkpoint in fewer, larger shards", file=model_dir)
    for f in files:
        check_entry(model_dir, f.name)
    index = model_dir / "model.safetensors.index.json"
    if os.path.lexists(index):
        doc = read_json(model_dir, index.name)
        weight_map = doc.get("weight_map", {}) if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise LayoutError("invalid shard index: 'weight_map' must map tensor names to file names",
                              file=index)
        named = set(weight_map.values())
        bad = sorted(n for n in named if not _SHARD_NAME.fullmatch(n))
        if bad:
            raise LayoutError(f"shard index names files that are not model*.safetensors in the model "
                              f"directory: {bad[:4]}", file=index)
        missing = sorted(n for n in named if model_dir / n not in files)
        if missing:
            raise LayoutError(f"shard index names missing files: {missing}", file=index)
    return files


def read_headers(model_dir: Path) -> list[SafetensorsHeader]:
    """The validated headers of every weight file (no tensor data is read)."""
    return [read_header(p) for p in weight_files(Path(model_dir))]


def check_half_dtypes(headers: list[SafetensorsHeader]) -> None:
    """Half-precision tensors of one checkpoint share one type: a tensor whose header says
    F16 among BF16 ones (or the reverse) holds bytes of the other type, and is refused."""
    halves = [(h, name, e.dtype) for h in headers for name, e in h.tensors.items() if e.dtype in ("F16", "BF16")]
    kinds = [d for _, _, d in halves]
    if len(set(kinds)) <= 1:
        return
    major = max(set(kinds), key=kinds.count)
    h, name, dtype = next(x for x in halves if x[2] != major)
    raise LayoutError(f"dtype {dtype} among {kinds.count(major)} {major} tensors: a checkpoint stores its "
                      f"half-precision tensors in one type", file=h.path, tensor=name)


def check_quantized_groups(headers: list[SafetensorsHeader]) -> None:
    """Every quantized tensor is whole: ``X.scales`` (or ``X.biases``) without ``X.weight``
    beside it (a renamed or deleted key, a flipped header byte) is refused naming the file
    and the missing key, before any module is built from the headers."""
    names = {name for h in headers for name in h.tensors}
    for h in headers:
        for name in h.tensors:
            for part in (".scales", ".biases"):
                if name.endswith(part):
                    weight = name[: -len(part)] + ".weight"
                    if weight not in names:
                        raise LayoutError(f"{name} is in the checkpoint but {weight} is in no weight file: a quantized "
                                          "tensor needs its weight, scales and biases", file=h.path, tensor=weight)


def max_dimension(headers: list[SafetensorsHeader]) -> int:
    return max((d for h in headers for e in h.tensors.values() for d in e.shape), default=1)


class CheckpointIndex:
    """Headers of every shard, and the expert byte ranges of every MoE layer."""

    def __init__(self, model_dir: str | Path, spec: MoESpec, config: dict | None = None,
                 headers: list[SafetensorsHeader] | None = None,
                 layouts: dict[int, list[tuple[str, tuple[int, ...], str]]] | None = None):
        """``layouts``: per MoE layer, (name, shape, dtype) of its switch module's stacked
        tensors (``edge0.backend.nn.switch_layout``)."""
        self.model_dir = Path(model_dir)
        self.spec = spec
        if config is not None:
            refuse_unsafe(self.model_dir, config)
        self.headers: list[SafetensorsHeader] = headers if headers is not None else read_headers(self.model_dir)
        self.entries: dict[str, tuple[SafetensorsHeader, TensorEntry]] = {}
        for header in self.headers:
            for name, entry in header.tensors.items():
                if name in self.entries:
                    raise LayoutError(
                        f"duplicate key: also stored in {self.entries[name][0].path}",
                        file=header.path, tensor=name)
                self.entries[name] = (header, entry)
        if config is not None:
            self._check_quantized_triples(config)
        self.layers: dict[int, LayerExperts] = {l: self._layer(l, layouts[l]) for l in spec.moe_layers}

    # -- queries --------------------------------------------------------------------------
    @property
    def expert_bytes_total(self) -> int:
        return sum(le.expert_bytes * self.spec.num_experts for le in self.layers.values())

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for _, e in self.entries.values())

    @property
    def files(self) -> list[str]:
        return [h.path for h in self.headers]

    def header_of(self, path: str) -> SafetensorsHeader:
        return next(h for h in self.headers if h.path == path)

    # -- validation -------------------------------------------------------------------------
    def _entry(self, key: str) -> tuple[SafetensorsHeader, TensorEntry]:
        try:
            return self.entries[key]
        except KeyError:
            raise LayoutError(
                f"missing tensor: expected {key!r} for MoE layer (config.json lists it as MoE) "
                f"in {', '.join(Path(h.path).name for h in self.headers)}",
                file=self.model_dir, tensor=key) from None

    def _layer(self, layer: int, expected: list[tuple[str, tuple[int, ...], str]]) -> LayerExperts:
        """Each stacked tensor the model's switch module holds, found in the files with the
        shape and dtype it must have. ``expected``: (name, shape, dtype) of the module's
        parameters, dtype a safetensors name or "float" (any of F16, BF16, F32)."""
        spec = self.spec
        switch = spec.switch_path(layer)
        locs: list[TensorLocation] = []
        floats = set()
        for name, shape, dtype in expected:
            key = f"{switch}.{name}"
            header, entry = self._entry(key)
            if len(entry.shape) != len(shape):
                raise LayoutError(f"shape {list(entry.shape)} has {len(entry.shape)} dimensions, the model's expert "
                                  f"stack has {len(shape)} ({list(shape)})", file=header.path, tensor=key)
            if entry.shape[0] != shape[0]:
                raise LayoutError(f"expert count {entry.shape[0]} differs from config.json's {shape[0]}",
                                  file=header.path, tensor=key)
            if tuple(entry.shape) != tuple(shape):
                q = spec.expert_quant(layer, name)
                how = f"int{q.bits} group {q.group_size} packing" if q is not None else "an unquantized stack"
                raise LayoutError(f"shape {list(entry.shape)} is inconsistent with config.json ({how}): expected "
                                  f"{list(shape)}", file=header.path, tensor=key)
            if dtype == "float":
                if entry.dtype not in _SCALE_DTYPES:
                    raise LayoutError(f"dtype {entry.dtype}, expected one of {_SCALE_DTYPES}", file=header.path,
                                      tensor=key)
                floats.add(entry.dtype)
            elif entry.dtype != dtype:
                raise LayoutError(f"dtype {entry.dtype}, expected {dtype}" + (" (packed quantized words)"
                                  if dtype == "U32" else ""), file=header.path, tensor=key)
            row = entry.nbytes // shape[0]
            locs.append(TensorLocation(key, header.path, entry.dtype, entry.file_offset(header.data_start), row,
                                       tuple(entry.shape[1:])))
        if len(floats - {"F32"}) > 1:
            raise LayoutError(f"the expert stack mixes half-precision types {sorted(floats)}", file=self.model_dir,
                              tensor=switch)
        return LayerExperts(layer, tuple(n for n, _, _ in expected), tuple(locs))

    def _check_quantized_triples(self, config: dict) -> None:
        """Every quantized module's weight/scales/biases agree with its bits and group size."""
        q = config.get("quantization") or (config.get("text_config") or {}).get("quantization") or {}
        for key in self.entries:
            if not key.endswith(".scales"):
                continue
            module = key[: -len(".scales")]
            override = q.get(module) if isinstance(q.get(module), dict) else {}
            bits = override.get("bits", q.get("bits"))
            group = override.get("group_size", q.get("group_size"))
            if not isinstance(bits, int) or not isinstance(group, int):
                continue
            w_key, b_key = module + ".weight", module + ".biases"
            header, scales = self.entries[key]
            if w_key not in self.entries:
                raise LayoutError(f"quantized module has scales but no weight {w_key!r}",
                                  file=header.path, tensor=key)
            wh, weight = self.entries[w_key]
            if b_key in self.entries and tuple(self.entries[b_key][1].shape) != tuple(scales.shape):
                bh, biases = self.entries[b_key]
                raise LayoutError(f"biases shape {list(biases.shape)} differs from scales shape "
                                  f"{list(scales.shape)}", file=bh.path, tensor=b_key)
            if not weight.shape or not scales.shape:
                continue
            in_from_weight = weight.shape[-1] * 32 // bits
            in_from_scales = scales.shape[-1] * group
            if weight.shape[:-1] != scales.shape[:-1] or in_from_weight != in_from_scales:
                raise LayoutError(
                    f"int{bits} packed shape {list(weight.shape)} is inconsistent with scales "
                    f"{list(scales.shape)} at group size {group}: weight implies {in_from_weight} "
                    f"inputs, scales imply {in_from_scales}", file=wh.path, tensor=w_key)
