"""The one place a checkpoint directory is opened.

Every check of config.json and of the weight files' headers runs before any constructor
and before any tensor byte is read (``validated``); then mlx-lm's model is built as a
skeleton, its MoESpec derived, each MoE layer's expert template quantized as the checkpoint
stores it, and the byte range of every expert indexed. ``load_spec``, ``open_checkpoint``
and the streaming loader (``edge0.loader``) all go through ``open_model``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edge0.backend import nn as bnn
from edge0.errors import ConfigError
from edge0.model.arch import check_streamable, derive_spec
from edge0.model.checkpoint import (CheckpointIndex, check_half_dtypes, check_quantized_groups, max_dimension,
                                   read_headers, refuse_unsafe)
from edge0.model.config_check import (check_fractions, check_nested, check_quantization, check_required, check_rotary,
                                      check_values, layer_bound)
from edge0.model.spec import MoESpec, load_config, with_experts_per_token


def validated(model_dir: Path, experts_per_token: int | None = None) -> tuple[dict, list]:
    """config.json and the weight files' headers, every check done before any constructor
    runs and before any tensor byte is read."""
    raw = with_experts_per_token(load_config(model_dir), experts_per_token)
    refuse_unsafe(model_dir, raw)
    check_streamable(raw)
    if not isinstance(raw.get("quantization") or (raw.get("text_config") or {}).get("quantization"), dict):
        raise ConfigError(f"{raw.get('model_type')} checkpoint is not quantized (config.json has no 'quantization'): "
                          "Edge0 streams quantized mlx-lm checkpoints; convert with `mlx_lm.convert -q --q-bits 4 "
                          "--q-group-size 64`")
    check_quantization(raw)
    headers = read_headers(model_dir)
    annotations = bnn.arg_annotations(raw)
    bounds = dict(max_dim=max_dimension(headers), layers=layer_bound(name for h in headers for name in h.tensors))
    check_values(raw, annotations, **bounds)
    check_nested(raw, annotations, **bounds)
    check_required(raw)
    check_fractions(raw)
    check_half_dtypes(headers)
    check_quantized_groups(headers)
    return raw, headers


def expert_templates(model, spec: MoESpec, raw: dict, headers) -> dict:
    """Each MoE layer's switch module, quantized as the checkpoint stores its experts: the
    code the executors run on their rows."""
    shapes = {name: tuple(e.shape) for h in headers for name, e in h.tensors.items()}
    q = raw.get("quantization") or (raw.get("text_config") or {}).get("quantization") or {}
    out = {}
    for layer in spec.moe_layers:
        template = bnn.module_at(model, spec.switch_path(layer))
        bnn.quantize_switch(template, shapes, spec.switch_path(layer), q)
        out[layer] = template
    return out


@dataclass
class OpenedModel:
    """A checked checkpoint directory: config, headers, mlx-lm's model as a skeleton (no
    tensor loaded), its MoESpec, the expert templates and the expert byte ranges."""

    raw: dict
    headers: list
    model: object
    spec: MoESpec
    templates: dict
    index: CheckpointIndex


def open_model(model_dir: str | Path, experts_per_token: int | None = None) -> OpenedModel:
    model_dir = Path(model_dir)
    raw, headers = validated(model_dir, experts_per_token)
    model = bnn.build_model(raw)
    check_rotary(bnn.rotary_dims(model), raw)
    spec = derive_spec(model, raw)
    templates = expert_templates(model, spec, raw, headers)
    index = CheckpointIndex(model_dir, spec, raw, headers=headers,
                            layouts={l: bnn.switch_layout(t) for l, t in templates.items()})
    return OpenedModel(raw, headers, model, spec, templates, index)


def open_checkpoint(model_dir: str | Path, experts_per_token: int | None = None):
    """(spec, index, templates) of ``model_dir``: every check of config.json and the weight
    headers, mlx-lm's model as a skeleton, and the byte ranges of every expert. No tensor
    byte is read."""
    opened = open_model(model_dir, experts_per_token)
    return opened.spec, opened.index, opened.templates


def load_spec(model_dir: str | Path, experts_per_token: int | None = None) -> MoESpec:
    """The MoESpec of a checkpoint directory (config.json and the weight headers are
    checked first; mlx-lm's model is built as a skeleton, no weight is read)."""
    raw, _ = validated(Path(model_dir), experts_per_token)
    model = bnn.build_model(raw)
    check_rotary(bnn.rotary_dims(model), raw)
    return derive_spec(model, raw)

