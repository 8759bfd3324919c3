"""The backend's ``nn`` surface for MLX: model classes, building and loading the resident
part of a model, and the model-level helpers the engine, the checkpoint index and
training use.

This module only gathers the names; each responsibility lives in its own module beside it:

- ``tree``: module paths and edits of the module tree, linear / switch predicates, widths;
- ``convert``: quantizing switch templates, their tensor layout, dequantizing and casting;
- ``models``: mlx-lm's model classes, building a model, loading its resident part;
- ``generation``: the tokenizer, the generation step and the prompt (KV) cache;
- ``cache_file``: a prompt cache file's layout, checked before mlx-lm builds anything from it;
- ``training``: building blocks for the small trainable prerouter heads;
- ``split``: quantized projections whose output rows run over several streams.
"""

from __future__ import annotations

from edge0.backend.mlx.convert import cast_model, dequantize_model, quantize_switch, switch_layout
from edge0.backend.mlx.generation import (
    batch_cache,
    cache_nbytes,
    kv_group_problem,
    quantize_kv,
    empty_batch_cache,
    extend_batch_cache,
    extract_batch_row,
    filter_batch_cache,
    is_plain_kv_cache,
    row_sampling,
    cache_trimmable,
    check_start_cache,
    copy_prefix,
    draft_greedy,
    load_cache_file,
    load_tokenizer,
    make_cache,
    rebuild_tokenizer,
    tokenizer_parts,
    trim_cache,
    trim_rows,
)
from edge0.backend.mlx.models import (
    arg_annotations,
    build_model,
    load_full_model,
    load_teacher,
    load_resident,
    model_classes,
    kv_width,
    rotary_dims,
)
from edge0.backend.mlx.split import SPLIT_MIN_WEIGHTS, SplitQuantizedLinear
from edge0.backend.mlx.split import split_projections as _split_projections
from edge0.backend.mlx.training import (
    Linear,
    adamw,
    load_parameters_flat,
    log_sigmoid,
    parameters_flat,
    router_weight,
    silu,
    value_and_grad,
)
from edge0.backend.mlx.tree import (
    Module,
    children,
    hidden_width,
    intercept,
    is_linear,
    is_switch,
    linear_dims,
    linear_modules,
    module_at,
    set_module_at,
    switch_experts,
    switch_output_width,
    token_embedding,
)


def split_projections(model: Module, threads: int, min_weights: int | None = None) -> int:
    """``split.split_projections``, whose default threshold is this module's
    ``SPLIT_MIN_WEIGHTS`` as it stands at call time (the setting is tuned here, on the
    facade)."""
    return _split_projections(model, threads, SPLIT_MIN_WEIGHTS if min_weights is None else min_weights)


__all__ = [
    "Linear", "Module", "SPLIT_MIN_WEIGHTS", "SplitQuantizedLinear", "adamw", "arg_annotations", "build_model",
    "cache_nbytes", "cache_trimmable", "quantize_kv", "kv_group_problem", "cast_model", "children", "dequantize_model",
    "hidden_width", "intercept", "is_linear", "is_switch", "linear_dims", "linear_modules", "load_full_model", "load_teacher",
    "load_parameters_flat", "load_resident", "load_tokenizer", "log_sigmoid", "make_cache", "model_classes",
    "module_at", "parameters_flat", "quantize_switch", "router_weight", "set_module_at", "silu",
    "kv_width", "rotary_dims", "split_projections", "switch_experts", "switch_layout", "switch_output_width", "token_embedding",
    "trim_cache", "value_and_grad", "copy_prefix", "batch_cache", "empty_batch_cache", "extend_batch_cache", "extract_batch_row",
    "filter_batch_cache", "is_plain_kv_cache", "row_sampling", "check_start_cache", "load_cache_file",
    "rebuild_tokenizer", "tokenizer_parts", "draft_greedy", "trim_rows",
]
