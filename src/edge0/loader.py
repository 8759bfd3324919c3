"""Opening a checkpoint for streaming: checks, the resident model, executors, artifacts.

``load_streaming_model`` validates the directory (files, config values, headers) before any
constructor runs, builds mlx-lm's model, derives what to stream from it (``edge0.model.arch``),
replaces every expert stack by a ``StreamingSwitch`` and every router by a ``RouterTap``
(``edge0.exec.taps``; the blocks themselves run unchanged), loads the resident tensors,
wires the executor paths, the prerouter heads and the adapters found beside the checkpoint
(or named by the config), and returns a ``Streaming``: everything a generation needs. The
engine (``edge0.engine``) runs it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from edge0.adapters import load_adapters
from edge0.backend import core as B
from edge0.backend import kernels as bk
from edge0.backend import nn as bnn
from edge0.config import PATHS, PHASES, EngineConfig
from edge0.errors import ConfigError
from edge0.exec.budget import MemoryPlan, kv_bytes_per_token, plan_memory
from edge0.exec.hot import HotExecutor
from edge0.exec.mapped import MappedExperts
from edge0.exec.oracle import OracleRouting, RoutingRecorder
from edge0.exec.pipeline import pipeline_part
from edge0.exec.rows import ExactExecutor, Split, resolve_threads
from edge0.exec.plan import PrerouterPlanner
from edge0.exec.staged import Stager
from edge0.exec.whole_layer import WholeLayerExecutor
from edge0.io_sched.direct import direct_reads, drop_cached, over_memory, wants_direct
from edge0.io_sched.expert_cache import ExpertCache
from edge0.io_sched.reader import ExpertReader
from edge0.model.files import check_entry
from edge0.model.open import open_model
from edge0.prerouter.files import HEADS_FILENAME, load_heads, serving_of
from edge0.prerouter.quantized import planned_bytes as quantized_heads_bytes, quantizable
from edge0.prerouter.runtime import Prerouter, blas_threads_controllable
from edge0.exec.taps import RouterTap, StepContext, StreamingSwitch
from edge0.streaming import Parts, Probes, Streaming, TokenEmbedding


def _expert_cache(plan: MemoryPlan, index, layers: list[int]) -> ExpertCache | None:
    """The reader's expert cache of the plan's bytes (None: none planned)."""
    expert_bytes = max(index.layers[l].expert_bytes for l in layers)
    return ExpertCache(plan.cache, plan.policy, expert_bytes) if plan.cache >= expert_bytes else None


def make_plan(config: EngineConfig, opened, pipe, layers: list[int], on: dict, width: int, compute_dtype: str, *,
              direct: bool, heads: int = 0, limit: int | None = None, runtime: int | None = None) -> MemoryPlan:
    """The memory plan of an opened checkpoint skeleton (``edge0.model.open``): no tensor
    byte of it read. ``Engine.open`` and ``edge0 plan`` both make it here."""
    kv, note = kv_bytes_per_token(opened.model, DTYPE_BYTES[compute_dtype], config.kv_bits, config.kv_group_size)
    kernels = bk.resolve(config.kernels, cpu=B.is_cpu(), compute_dtype=compute_dtype)
    files = {t.file for l in layers for t in opened.index.layers[l].tensors}
    return plan_memory(config, opened.index, opened.spec, pipe, layers, on, width, direct=direct, kv_per_token=kv,
                       kv_note=note, compute_bytes=DTYPE_BYTES[compute_dtype], heads=heads, limit=limit,
                       runtime=runtime, kernels=kernels, files_bytes=sum(os.path.getsize(f) for f in files))


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def resolve_compute_dtype(name: str, config: dict) -> str:
    """``auto``: float32 on MLX's CPU backend, else the checkpoint's own float dtype."""
    if name != "auto":
        return name
    if B.is_cpu():
        return "float32"
    stored = config.get("torch_dtype") or (config.get("text_config") or {}).get("torch_dtype")
    return stored if stored in ("bfloat16", "float16", "float32") else "bfloat16"


def _kernels(config: EngineConfig, compute_dtype: str, templates: list) -> tuple[str, Split]:
    """The kernels the engine computes with (``edge0`` or ``mlx``) and the expert stacks'
    split over streams. Edge0's kernels split each call's output rows over their own
    threads, so a stack is one call; MLX's run one call per stream, one stream per thread.
    Edge0's are put in the templates before any executor binds one."""
    kernels = bk.resolve(config.kernels, cpu=B.is_cpu(), compute_dtype=compute_dtype)
    threads = resolve_threads(config.compute_threads)
    int8 = config.int8_products == "on"
    if kernels == "mlx":
        if int8:
            raise ConfigError("int8_products='on' is a mode of Edge0's kernels, and kernels resolve to mlx here "
                              "(kernels='edge0' on MLX's CPU device with compute_dtype float32)")
        return kernels, Split(threads)  # streams of this (the compute) thread
    if not bk.set_int8_products(int8):
        raise ConfigError("int8_products='on' multiplies with AVX-512 VNNI, which this CPU does not have "
                          "(int8_products='off')")
    bk.set_threads(threads)
    bk.use_edge0(*templates)
    return kernels, Split(1)


def _paths(config: EngineConfig, layers: list[int], heads) -> dict[tuple[int, str], str]:
    """(layer, phase) -> executor path; the heads' consumer layers decode staged."""
    for layer, _, _ in config.layer_paths:
        if layer not in layers:
            raise ConfigError(f"layer_paths names layer {layer}, which is not a MoE layer; MoE layers: {layers}")
    decode = {l: config.path_for(l, "decode") for l in layers}
    if heads is not None:
        explicit = {l for l, ph, _ in config.layer_paths if ph == "decode"}
        for l in heads.consumers():
            if l in decode and l not in explicit:
                decode[l] = "staged"
        unpredicted = [l for l, p in decode.items() if p == "staged" and l not in heads.consumers()]
        if unpredicted:
            raise ConfigError(f"layers {unpredicted} decode staged but no prerouter head predicts them "
                              f"(heads predict {heads.consumers()})")
    path_of = {(l, "decode"): decode[l] for l in layers}
    path_of.update({(l, "prefill"): config.path_for(l, "prefill") for l in layers})
    return path_of


def _unpredicted(config: EngineConfig, layers: list[int], path_of: dict, heads) -> set[tuple[int, str]]:
    """(layer, "decode") of the MoE layers that decode exact because no head predicts them
    while others decode staged on the heads (the first MoE layer), and that ``layer_paths``
    does not name: those ``unpredicted_layers`` may hold resident."""
    if heads is None or not any(path_of[l, "decode"] == "staged" for l in layers):
        return set()
    explicit = {l for l, ph, _ in config.layer_paths if ph == "decode"}
    return {(l, "decode") for l in layers
            if path_of[l, "decode"] == "exact" and l not in heads.consumers() and l not in explicit}


def prerouter_mode(config: EngineConfig, heads=None) -> tuple[str, str]:
    """(dtype, flush) that ``prerouter_dtype`` and ``prerouter_flush`` resolve to for
    ``heads``. auto on the CPU backend in float32: Edge0's kernels in 8-bit weights where
    the kernels resolve to edge0 and the heads' widths quantize, else NumPy's products held
    to one BLAS thread; MLX elsewhere."""
    dtype = config.prerouter_dtype
    if dtype == "auto":
        dtype = "float32" if B.is_cpu() else "float16"
    flush = config.prerouter_flush
    if flush == "auto" and B.is_cpu() and dtype == "float32":
        compute = "float32" if config.compute_dtype == "auto" else config.compute_dtype
        on_edge0 = bk.resolve(config.kernels, cpu=True, compute_dtype=compute) == "edge0"
        flush = ("edge0" if on_edge0 and heads is not None and quantizable(heads)
                 else "numpy" if blas_threads_controllable() else "mlx")
    elif flush == "auto":
        flush = "mlx"
    if flush in ("numpy", "edge0") and dtype != "float32":
        raise ConfigError(f"prerouter_flush {flush} computes in float32; prerouter_dtype {dtype} needs "
                          "prerouter_flush mlx (or auto)")
    return dtype, flush


def _heads_bytes(config: EngineConfig, heads) -> int:
    """The heads' memory as the prerouter will hold them: the flush's copy (NumPy's float32
    one on the host, the 8-bit one of Edge0's kernels, else MLX's stacked in the flush's
    dtype); the loaded copy is freed once it is made, before the expert cache is allocated."""
    if heads is None:
        return 0
    dtype, flush = prerouter_mode(config, heads)
    if flush == "edge0":
        return quantized_heads_bytes(heads)
    per_element = 4 if flush == "numpy" else DTYPE_BYTES[dtype]
    return sum(per_element * a.size for a in bnn.parameters_flat(heads).values())


def _make_prerouter(config: EngineConfig, heads, width: int | None) -> Prerouter | None:
    """The decode-time prerouter over ``heads`` (None: no heads), its flush where
    ``prerouter_flush`` and ``prerouter_dtype`` resolve to; ``width``: experts staged per
    consumer (select routing), None: k (the prediction is the routing)."""
    if heads is None:
        return None
    dtype, flush = prerouter_mode(config, heads)
    return Prerouter(heads, dtype=B.dtype(dtype), on_host=flush == "numpy", width=width, quantized=flush == "edge0")


@dataclass
class Layout:
    """A checkpoint laid out before one tensor byte is read: its skeleton (``opened``), the
    oracle or heads that stage it, the routing, a pipeline rank's part, every layer's paths
    and the memory plan."""

    opened: object
    oracle: OracleRouting | None
    heads: object
    heads_path: Path | None
    routing: str
    extra: int
    pipe: object
    config: EngineConfig
    layers: list
    path_of: dict
    on: dict
    compute_dtype: str
    plan: MemoryPlan
    over_memory_routing: bool = False  # the heads file's choice for a checkpoint over memory changed the routing


def lay_out(model_dir: Path, config: EngineConfig, oracle: OracleRouting | None = None, *,
            limit: int | None = None, runtime: int | None = None) -> Layout:
    """Everything decided before loading (``limit``, ``runtime``: the memory the process may
    use and holds, measured when None). ``edge0 plan`` prints its plan."""
    opened = open_model(model_dir, config.experts_per_token)
    spec, index = opened.spec, opened.index
    if oracle is None and config.oracle_file and config.staged_source != "prerouter":
        oracle = OracleRouting.load(config.oracle_file)
    if oracle is not None:
        oracle.check(spec.moe_layers, spec.num_experts)
    heads, heads_path, heads_meta = _load_heads(model_dir, config, oracle, spec)
    over = over_memory(index.files, limit)
    routing, extra = resolve_routing(config, heads_meta, spec, heads_path, over)
    pipe, config, heads = pipeline_part(config, opened.model, spec, index, heads)
    layers = [l for l in spec.moe_layers if pipe is None or pipe.layout.holds(l)]
    path_of = _paths(config, layers, heads)
    compute_dtype = resolve_compute_dtype(config.compute_dtype, opened.raw)

    def planned(paths):
        on = {p: [l for l in layers if p in (paths[l, "prefill"], paths[l, "decode"])] for p in PATHS}
        on["resident"] = [l for l in layers if paths[l, "decode"] == "hot" and (l, "decode") in unpredicted]
        return paths, on, make_plan(config, opened, pipe, layers, on, spec.k + extra, compute_dtype,
                                    direct=direct_reads(config.direct_io, index.files, limit),
                                    heads=_heads_bytes(config, heads), limit=limit, runtime=runtime)

    unpredicted = _unpredicted(config, layers, path_of, heads)
    path_of, on, plan = planned(path_of)  # (over the mapping exact reads nothing: no layer is held whole)
    if unpredicted and config.unpredicted_layers == "resident" and plan.source == "slots":
        path_of, on, plan = planned({**path_of, **{key: "hot" for key in unpredicted}})
    if on["staged"] and extra and plan.source == "slots" and plan.slots < spec.k + extra:  # (fewer than k: the Stager says so)
        raise ConfigError(f"slots_per_layer={plan.slots} cannot hold the {spec.k + extra} experts select routing "
                          f"stages per layer (k={spec.k} + stage_extra={extra})")
    chose_over = over and (routing, extra) != resolve_routing(config, heads_meta, spec, heads_path)
    return Layout(opened, oracle, heads, heads_path, routing, extra, pipe, config, layers, path_of, on, compute_dtype,
                  plan, chose_over)


def load_streaming_model(model_dir: str | Path, config: EngineConfig, *, oracle: OracleRouting | None = None,
                         record: bool = False, log=None) -> Streaming:
    """Open ``model_dir`` for streaming: mlx-lm's model with every expert stack replaced by a
    StreamingSwitch and every router by a RouterTap, the resident tensors loaded, the
    executor paths, prerouter heads and adapters wired."""
    model_dir = Path(model_dir)
    lay = lay_out(model_dir, config, oracle)
    opened, oracle, heads, heads_path, routing, extra = lay.opened, lay.oracle, lay.heads, lay.heads_path, \
        lay.routing, lay.extra
    pipe, config, layers, path_of, on, compute_dtype, plan = lay.pipe, lay.config, lay.layers, lay.path_of, lay.on, \
        lay.compute_dtype, lay.plan
    model, spec, raw, index, templates = opened.model, opened.spec, opened.raw, opened.index, opened.templates
    if plan.direct and heads_path is not None:  # the heads file's pages: memory the plan gave the cache
        drop_cached([heads_path])
    reader = ExpertReader(index, config.reader_threads, log=log, direct=wants_direct(config.direct_io, index.files))
    context, stager = StepContext(), None  # what each forward pass is: its Step, installed by the step hook
    try:
        kernels, split = _kernels(config, compute_dtype, [templates[layer] for layer in layers])
        mapped = MappedExperts(index, templates, layers) if plan.source == "mapping" else None
        exact = ExactExecutor(index, reader, config.bundle_capacity, templates, log=log, mapped=mapped)
        exact.split = split
        recorder = exact.recorder = RoutingRecorder() if record else None
        hot = (HotExecutor(index, reader, config.hot_experts, exact, log=log, resident=on["resident"])
               if on["hot"] and not mapped else None)  # (with the mapping, hot and whole-layer compute as exact)
        whole = (WholeLayerExecutor(index, reader, on["whole_layer"], templates, log=log, split=exact.split)
                 if on["whole_layer"] and not mapped else None)
        prerouter = _make_prerouter(config, heads, spec.k + extra if routing == "select" else None)
        reader.cache = _expert_cache(plan, index, layers)  # after the heads' loaded copy is freed
        probes, embed = Probes(model, spec, context), _embedding(lay, model)  # (their probes: once it is wired)
        if on["staged"]:
            planner = (PrerouterPlanner(prerouter, on["staged"], routing, probes.route, embed)
                       if prerouter is not None else None)
            stager = Stager(index, on["staged"], plan.slots, reader, None if prerouter is not None else oracle,
                            readers=config.reader_threads, prefetch_depth=config.prefetch_depth, log=log,
                            planner=planner, fallback=exact, guard_every=config.guard_every,
                            max_slots=plan.ceiling, in_place=mapped is not None, context=context)
        paths = {"exact": exact, "hot": hot or exact, "whole_layer": whole or exact, "staged": stager}
        for layer in layers:
            template = templates[layer]
            width_out = bnn.switch_output_width(template)
            executors = {ph: paths[path_of[layer, ph]] for ph in PHASES}
            bnn.set_module_at(model, spec.switch_path(layer), StreamingSwitch(layer, template, executors, width_out,
                                                                                 context))
        skip = spec.is_expert_key
        if pipe is not None:
            pipe.strip(B.dtype(compute_dtype))
            skip = lambda key: spec.is_expert_key(key) or pipe.remote_key(key)
        model = bnn.load_resident(model, model_dir, raw, index.files, skip, B.dtype(compute_dtype))
        if plan.direct:  # the resident weights' pages in the page cache: memory the plan gave the cache
            drop_cached(index.files)
        if kernels == "edge0":
            bk.use_edge0(model)  # attention, shared experts, lm_head, quantized routers
        else:
            bnn.split_projections(model, exact.split.threads)  # attention and other large projections: both cores too
        for layer, m in spec.layers.items():
            if m.router_path and layer in layers:
                original = bnn.module_at(model, m.router_path)
                bnn.set_module_at(model, m.router_path, RouterTap(layer, original, m.router_kind, m.router_outputs,
                                                                             context))
        adapters = load_adapters(model_dir, config, model, spec, heads_path, log,
                                  held=None if pipe is None else (lambda m: not pipe.remote_module(m)), context=context)
    except BaseException:
        if stager is not None:
            stager.close()
        reader.close()
        raise
    try:
        streaming = Streaming(Parts(model, index, reader, exact, hot, whole, stager, recorder, prerouter, heads_path,
                                    adapters, context, lay, kernels, bk.describe() if kernels == "edge0" else "mlx",
                                    *_served(lay, prerouter, stager, embed), probes))
        if pipe is not None:
            pipe.wire(streaming, prerouter)  # the boundary layers send and receive
        return streaming
    except BaseException:
        if stager is not None:
            stager.close()
        if whole is not None:
            whole.close()
        reader.close()
        raise


def _embedding(lay: Layout, model):
    """The token embedding the heads that see the token read (ids -> rows): a pipeline
    rank's embeds the rows the first rank relays."""
    pipe, heads = lay.pipe, lay.heads
    if pipe is not None and pipe.rank > 0 and heads is not None and heads.sees_token:
        return pipe.relayed_embedding(heads.token_dim)
    return TokenEmbedding(model)


def _served(lay: Layout, prerouter, stager, embed) -> tuple:
    """(the routing served, the heads the stats line names, the token embedding, the decode
    hooks): a pipeline rank's names all ranks' heads and relays before the Stager plans."""
    pipe = lay.pipe
    hooks = ((lambda inputs, heads: pipe.begin_step(inputs, embed),) if pipe is not None else ()) + \
        ((stager.begin_step,) if stager is not None else ())
    served = (lay.routing, lay.extra) if prerouter is not None or (pipe is not None and pipe.heads) else None
    shown = pipe.heads if pipe is not None and pipe.heads is not None else getattr(prerouter, "heads", None)
    return served, shown, embed, hooks


def resolve_routing(config: EngineConfig, meta: dict | None, spec, heads_path,
                    over: bool = False) -> tuple[str, int]:
    """(routing mode, experts staged beyond k): the config's, else what the heads file
    records (replace when it records nothing); where the checkpoint is larger than the
    memory the process may use (``over``), the record's ``over_memory`` routing when it
    has one; select without a count stages 2k. Without heads (``meta`` None) nothing is
    predicted: the staged set is the routed set."""
    if meta is None:
        return "replace", 0
    recorded = serving_of(meta, heads_path)
    if over and "over_memory" in recorded:
        recorded = recorded["over_memory"]
    mode = config.routing if config.routing != "auto" else recorded["routing"]
    if mode == "replace":
        if config.stage_extra:
            raise ConfigError(f"stage_extra={config.stage_extra} applies to routing 'select' (the heads file "
                              f"{heads_path} is served with routing 'replace'; pass --routing select)")
        return "replace", 0
    if config.stage_extra is not None:
        extra = config.stage_extra
    elif recorded["routing"] == "select":
        extra = recorded["stage_extra"]
    else:
        extra = spec.k
    if spec.k + extra > spec.num_experts:
        raise ConfigError(f"stage_extra={extra}: k + stage_extra = {spec.k + extra} is more than the "
                          f"{spec.num_experts} experts of a layer")
    return "select", extra


def _load_heads(model_dir: Path, config: EngineConfig, oracle, spec):
    """(the prerouter heads to use, their file, its metadata), or (None, None, None)."""
    if config.prerouter == "off" or config.staged_source == "oracle" or (
            config.staged_source == "auto" and oracle is not None):
        return None, None, None
    path = Path(config.prerouter_file) if config.prerouter_file else model_dir / HEADS_FILENAME
    if not path.exists():
        if config.prerouter == "on" or config.staged_source == "prerouter" or config.prerouter_file:
            raise ConfigError(f"prerouter heads {path} do not exist (train them with `edge0 train heads`)")
        return None, None, None
    if not config.prerouter_file:
        check_entry(model_dir, HEADS_FILENAME)
    if spec.prerouter_problem:
        raise ConfigError(f"prerouter heads {path} cannot drive {spec.model_type}: {spec.prerouter_problem} "
                          "(use --prerouter off)")
    heads, meta = load_heads(path, model_dir, spec=spec)
    return heads, path, meta
