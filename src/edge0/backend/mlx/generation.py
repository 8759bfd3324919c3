"""Tokenizer, token generation and the prompt cache (MLX, mlx-lm).

mlx-lm's tokenizer wrapper with its streaming detokenizer (``load_tokenizer``, its
failures turned into ``TokenizerError``), mlx-lm's sampler and logits processors built from
Edge0's sampling parameters (``row_sampling``), and the KV / state cache: making one
(``make_cache``), its size in bytes (``cache_nbytes``) and trimming tokens off its end
where its layers allow that (``cache_trimmable``, ``trim_cache``); a draft model's greedy
tokens (``draft_greedy``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from edge0.backend.mlx.cache_file import check_cache_file
from edge0.errors import ConfigError, Edge0Error, TokenizerError


def load_tokenizer(model_dir: Path):
    """mlx-lm's tokenizer wrapper (with its streaming detokenizer) for a local directory.
    Anything the tokenizer libraries raise is a ``TokenizerError`` naming the directory."""
    from mlx_lm.utils import load_tokenizer as _load

    try:
        return _load(Path(model_dir))
    except Edge0Error:
        raise
    except (Exception, RecursionError) as e:
        raise TokenizerError(f"the tokenizer does not load: {type(e).__name__}: {str(e)[:500]}",
                             file=model_dir) from None


def tokenizer_parts(tokenizer) -> tuple:
    """(the Hugging Face tokenizer, the chat-template renderer in Python or None) of mlx-lm's
    tokenizer wrapper: what ``rebuild_tokenizer`` makes the same wrapper of in another
    process (both pickle)."""
    return getattr(tokenizer, "_tokenizer", tokenizer), getattr(tokenizer, "_chat_template", None)


def rebuild_tokenizer(hf_tokenizer, renderer):
    """mlx-lm's tokenizer wrapper around ``tokenizer_parts``' parts."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return TokenizerWrapper(hf_tokenizer, chat_template=renderer)


def make_cache(model: nn.Module, max_kv_size: int | None = None) -> list:
    """A fresh KV / state cache for ``model`` (mlx-lm's, so hybrid models get theirs; with
    ``max_kv_size``, rotating KV caches of that size)."""
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model, max_kv_size=max_kv_size)


def load_cache_file(path) -> tuple[list, dict]:
    """A prompt cache file (``mlx_lm.cache_prompt``'s: mlx-lm's ``save_prompt_cache``) as
    (the cache, one entry per layer; its metadata). A file that is not one is a
    ``ConfigError`` naming it, and its layout is checked before mlx-lm builds anything
    from its names (``check_cache_file``: one hostile index would cost gigabytes)."""
    from mlx_lm.models import cache as mlx_cache
    from mlx_lm.models.cache import load_prompt_cache

    if not Path(path).is_file():
        raise ConfigError(f"prompt cache file {path}: no such file")
    check_cache_file(path, _cache_classes(mlx_cache))
    try:
        cache, metadata = load_prompt_cache(str(path), return_metadata=True)
    except (Exception, RecursionError) as e:  # noqa: BLE001 - whatever a foreign file makes mlx-lm raise
        raise ConfigError(f"prompt cache file {path} is not an mlx-lm prompt cache (mlx_lm.cache_prompt writes "
                          f"one): {type(e).__name__}: {str(e)[:300]}") from None
    if not isinstance(cache, list) or not cache or not isinstance(metadata, dict):
        raise ConfigError(f"prompt cache file {path} holds no cache")
    mx.eval([c.state for c in cache])  # read here: a lazy load is bound to this thread's stream
    return cache, metadata


def _cache_classes(module) -> set[str]:
    """The names ``load_prompt_cache`` may look up in its module: the cache classes defined there."""
    return {name for name, obj in vars(module).items()
            if isinstance(obj, type) and obj.__module__ == module.__name__ and hasattr(obj, "from_state")}


def check_start_cache(own: list, cache, kv_bits: int | None, kv_group_size: int) -> int:
    """The tokens a given prompt cache (a prefix's KV, e.g. ``load_cache_file``'s) holds,
    after checking it fits the model whose own fresh cache is ``own``: one entry per layer,
    each of the kind the model's own cache has (a plain KV cache may have been quantized: then with ``kv_bits`` and
    ``kv_group_size`` when those are set). ``ConfigError`` naming what does not fit."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    if not isinstance(cache, (list, tuple)) or len(cache) != len(own):
        n = len(cache) if isinstance(cache, (list, tuple)) else type(cache).__name__
        raise ConfigError(f"the prompt cache holds {n} layers; this model has {len(own)} (it was made for "
                          "another model)")
    for i, (c, o) in enumerate(zip(cache, own)):
        quantized = type(c) is QuantizedKVCache and type(o) is KVCache
        if type(c) is not type(o) and not quantized:
            raise ConfigError(f"the prompt cache's layer {i} is a {type(c).__name__}; this model's is a "
                              f"{type(o).__name__} (it was made for another model)")
        if quantized and kv_bits is not None and (c.bits, c.group_size) != (kv_bits, kv_group_size):
            raise ConfigError(f"kv_bits {kv_bits} / kv_group_size {kv_group_size} do not match the prompt cache's "
                              f"quantization ({c.bits} bits, groups of {c.group_size})")
    # evaluated on the caller's thread: arrays made lazily there cannot be computed on another
    mx.eval([c.state for c in cache])
    offsets = [c.offset for c in cache if isinstance(getattr(c, "offset", None), int)]
    if not offsets or min(offsets) < 1 or len(set(offsets)) > 1:
        raise ConfigError(f"the prompt cache holds no prefix, or layers of different lengths ({sorted(set(offsets))})")
    return offsets[0]


def row_sampling(params, extra_processors: tuple = (), xtc_special: tuple = ()) -> tuple:
    """(sampler, logits processors) of one generation, as mlx-lm makes them from ``params`` (a
    SamplingParams), then ``extra_processors`` (a constraint's mask last, so nothing lifts
    a token it masked); ``xtc_special``: the tokens XTC never drops (mlx-lm's server: the
    newline's and the EOS ids). The sampler takes log-probabilities [1, V] and the row's
    random key for this draw (``core.draw_key``) and returns [1]."""
    from mlx_lm.sample_utils import make_logits_processors

    processors = make_logits_processors(logit_bias=params.logit_bias, repetition_penalty=params.repetition_penalty,
                                        repetition_context_size=params.repetition_context_size,
                                        presence_penalty=params.presence_penalty,
                                        presence_context_size=params.presence_context_size,
                                        frequency_penalty=params.frequency_penalty,
                                        frequency_context_size=params.frequency_context_size)
    return _keyed_sampler(params, tuple(xtc_special)), list(processors) + list(extra_processors)


def _keyed_sampler(params, xtc_special: tuple):
    """mlx-lm's ``make_sampler`` chain (top-p, min-p, XTC, top-k, then a categorical draw at
    the temperature; greedy at 0), its filters mlx-lm's own, its random draws from the key
    the sampler is given (``core.sample``)."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    from edge0.backend.mlx.core import sample

    top_p = params.top_p if params.top_p < 1.0 else 0.0
    before = []  # the filters ahead of XTC, deterministic: (function, its arguments after the log-probabilities)
    if 0 < top_p < 1.0:
        before.append((apply_top_p, (top_p,)))
    if params.min_p != 0.0:
        before.append((apply_min_p, (params.min_p, params.min_tokens_to_keep)))
    xtc = (params.xtc_probability, params.xtc_threshold, list(xtc_special)) if params.xtc_probability > 0.0 else None
    top_k = (apply_top_k, params.top_k) if params.top_k > 0 else None
    return functools.partial(sample, temp=params.temp, before=tuple(before), xtc=xtc, top_k=top_k)


def is_plain_kv_cache(c) -> bool:
    """A layer cache that can join a batch: mlx-lm's plain ``KVCache``."""
    from mlx_lm.models.cache import KVCache

    return type(c) is KVCache


def batch_cache(caches: list[list]) -> list:
    """One batch cache (mlx-lm's left-padded ``BatchKVCache`` per layer) holding the given
    sequences' caches as its rows, in order."""
    from mlx_lm.models.cache import BatchKVCache

    return [BatchKVCache.merge([c[layer] for c in caches]) for layer in range(len(caches[0]))]


def empty_batch_cache(layers: int, left_padding: list[int]) -> list:
    """An empty batch cache (one ``BatchKVCache`` per layer) for sequences whose first
    pass is left-padded by ``left_padding`` tokens each."""
    from mlx_lm.models.cache import BatchKVCache

    return [BatchKVCache(list(left_padding)) for _ in range(layers)]


def extend_batch_cache(cache: list, other: list) -> None:
    """Append ``other``'s rows to ``cache``'s (in place)."""
    for a, b in zip(cache, other):
        a.extend(b)


def filter_batch_cache(cache: list, rows: list[int]) -> None:
    """Keep only the rows ``rows`` of a batch cache (in place)."""
    for c in cache:
        c.filter(rows)


def extract_batch_row(cache: list, row: int) -> list:
    """Row ``row`` of a batch cache as a sequence's own cache (new arrays, evaluated: a lazy
    slice would keep the whole batch's buffers alive as long as the copy lives)."""
    out = [c.extract(row) for c in cache]
    mx.eval([c.state for c in out])
    return out


def quantize_kv(cache: list, config) -> None:
    """mlx-lm's KV quantization (``maybe_quantize_kv_cache``) under ``config`` (an
    EngineConfig): each layer's KV cache that holds ``quantized_kv_start`` tokens or more
    becomes a ``QuantizedKVCache`` of ``kv_bits``, in place. A group size that does not
    divide the cached vectors is a ``ConfigError``."""
    from mlx_lm.generate import maybe_quantize_kv_cache

    bits, group_size, start = config.kv_bits, config.kv_group_size, config.quantized_kv_start
    try:
        maybe_quantize_kv_cache(cache, quantized_kv_start=start, kv_group_size=group_size, kv_bits=bits)
    except ValueError as e:
        if "divisible by the quantization group size" not in str(e):
            raise
        raise ConfigError(f"kv_group_size {group_size} does not divide this model's cached key and value vectors "
                          f"({e}): use 32, which divides every size a multiple of 32") from None


def kv_group_problem(model, group_size: int) -> str | None:
    """Why ``group_size`` cannot quantize this model's KV cache, from the head sizes its
    attention modules declare (``head_dim``, ``v_head_dim``, or ``k_proj`` / ``v_proj``
    rows over ``n_kv_heads``) and its arguments' ``head_dim``, or None."""
    def size(value):
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    sizes = {size(getattr(getattr(model, "args", None), "head_dim", None))}
    for _, module in model.named_modules():
        sizes |= {size(getattr(module, name, None)) for name in ("head_dim", "v_head_dim")}
        heads = size(getattr(module, "n_kv_heads", None))
        for proj in ("k_proj", "v_proj") if heads else ():
            weight = getattr(getattr(module, proj, None), "weight", None)
            if weight is not None and weight.shape[0] % heads == 0:
                sizes.add(weight.shape[0] // heads)
    sizes.discard(None)
    bad = sorted(v for v in sizes if v % group_size)
    if bad:
        return (f"kv_group_size {group_size} does not divide this model's attention head size {bad[0]}: use one "
                f"that does ({', '.join(str(g) for g in (32, 64, 128) if all(v % g == 0 for v in sizes)) or 'none'})")
    return None


def cache_nbytes(cache: list) -> int:
    """Bytes a prompt cache (one entry per layer) holds."""
    return sum(c.nbytes for c in cache)


def cache_trimmable(cache: list) -> bool:
    from mlx_lm.models.cache import can_trim_prompt_cache

    return can_trim_prompt_cache(cache)


def trim_cache(cache: list, n: int) -> bool:
    """Drop the last ``n`` tokens of a prompt cache; False when its layers cannot be trimmed
    (state-space and linear-attention layers keep a running state, rotating caches wrap)."""
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    if n == 0:
        return True
    if not can_trim_prompt_cache(cache):
        return False
    return trim_prompt_cache(cache, n) == n


def trim_rows(cache: list, drop: list[int]) -> None:
    """Drop the last ``drop[r]`` tokens of each row ``r`` of a cache (a verify pass's
    positions a row did not take): a sequence's own cache (one row) trimmed; a batch
    cache's rows trimmed by the fewest, and each row that drops more moved right by the
    difference, its left padding grown by as much (mlx-lm's ``prepare(right_padding=)`` /
    ``finalize``: its keys keep their positions, the padding is masked), then the padding
    every row has cut off the front."""
    from mlx_lm.models.cache import BatchKVCache

    least = min(drop)
    trim_cache(cache, least)
    extra = [d - least for d in drop]
    if not any(extra):
        return
    for c in cache:
        if not isinstance(c, BatchKVCache):
            raise TypeError(f"rows of a {type(c).__name__} cannot be trimmed apart")
        c.prepare(right_padding=extra)
        c.finalize()
        keys, values, offset, padding, end = c.state
        common = min(padding.tolist())
        if common:
            c.state = keys[..., common:, :], values[..., common:, :], offset, padding - common, end - common


def copy_prefix(cache: list, n: int) -> list | None:
    """A new prompt cache holding the first ``n`` tokens of ``cache``, which is left as it
    is; None when a layer's cache is not a plain KV cache (only those are copied)."""
    from mlx_lm.models.cache import KVCache

    if not all(type(c) is KVCache and c.keys is not None and c.offset >= n for c in cache):
        return None
    out = []
    for c in cache:
        new = KVCache()
        # new arrays (slices): the copy's writes never reach the entry's, nor the reverse
        new.keys, new.values, new.offset = c.keys[..., :n, :], c.values[..., :n, :], n
        out.append(new)
    return out


def draft_greedy(model: nn.Module, cache: list, feed: list[int], first: int, n: int) -> list[int]:
    """A draft model's greedy continuation on its own ``cache``: ``feed`` (the tokens before
    ``first`` its cache has not seen) forwarded in chunks, then ``first`` and each token it
    chooses (the argmax of its logits), ``n`` tokens chosen, as one graph evaluated once.
    The cache ends holding ``feed``, ``first`` and the first ``n - 1`` chosen."""
    for i in range(0, len(feed), 512):
        model(mx.array([feed[i:i + 512]]), cache=cache)
        mx.eval([c.state for c in cache])
    y, out = mx.array([[first]]), []
    for _ in range(n):
        y = mx.argmax(model(y, cache=cache)[:, -1, :], axis=-1, keepdims=True)
        out.append(y)
    return mx.concatenate(out).reshape(-1).tolist() if out else []

