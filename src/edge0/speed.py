"""The speed forecast (``edge0 plan --speed``): decode tokens per second and the time to the
first token of a stated prompt, on this machine, before the checkpoint is loaded.

A decode step is forecast from measured terms:

- **the engine's own step**: a replica of the checkpoint (its architecture, decoder and MoE
  layers, k, its widths and attention heads; fewer experts where its own would take more than
  ``REPLICA_EXPERT_BYTES``; random weights: ``edge0.tiny``) is benchmarked as ``edge0 bench``
  runs an arm, under the same settings. Its step holds the graph's ops and the kernels at
  the real widths, the engine's planning and the reads' hand-offs;
- **what the replica does not compute as the checkpoint does**: the step's quantized
  products (each resident projection; each MoE layer's routed experts, k a row) in the
  checkpoint's order on random weights of its shapes, evaluated together, less the same at
  the replica's (the head over a small vocabulary, the routers over fewer experts), the two
  timed in turns in one process (the machine's drift falls on both); the heads' flush over
  every expert likewise;
- **the replica's own copies**, taken out: on the layers that read on demand its step holds
  the copies of its experts into slots (its expert bytes a token at the copy rate), which
  the reads term counts at the checkpoint's bytes;
- **the reads** (the plan computes over slots): the plan's disk bytes a token over the
  drive's rate at the plan's request sizes (positional reads, as many threads as the
  engine's readers, the page cache bypassed; experts read the first time: a decode reads
  from the drive what neither its slots nor the expert cache held, read long before if ever,
  and a prompt reads its experts once), the other expert bytes (the expert cache's) at the
  memory's copy rate.

Layers decoding exact read on demand: the step waits for all of it. Staged layers' reads are
issued ahead and run beside the compute, which runs slower while they do (by as much as the
step's products measured beside the drive's reads; the copies' CPU taken from its cores):
the step is the longer of the two. Prefill is the replica's (of at most ``REPLICA_PROMPT`` tokens, scaled to the prompt), what a longer
prompt's attention adds (one chunk timed at the real heads, scaled by query x key
positions) and, over slots from the drive, every expert the prompt touches read once. Each
measurement is cached per CPU (kernels, replica) or per drive (``$EDGE0_CACHE/speed``), so a
second forecast measures nothing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import statistics
import tempfile
from pathlib import Path

REPLICA_EXPERT_BYTES = 1536 * 2**20  # at most this much routed-expert weight in the replica
# config.json keys of the attention's shape: copied into the replica (its widths are the checkpoint's)
HEAD_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim")
# config.json keys that say which layers are MoE, dense or of which attention: copied into the replica
PATTERN_KEYS = ("mlp_only_layers", "decoder_sparse_step", "first_k_dense_replace", "moe_layer_freq",
                "full_attention_interval", "layer_types", "moe_layers_enum", "sliding_window_pattern")
# the engine settings the replica's step depends on (paths, kernels, threads, flush); file settings and
# memory settings are the real checkpoint's business
REPLICA_SETTINGS = ("decode_path", "prefill_path", "kernels", "compute_threads", "reader_threads", "prefetch_depth",
                    "slots_per_layer", "stage_extra", "prerouter_flush", "prerouter_dtype", "unpredicted_layers",
                    "bundle_capacity", "hot_experts", "experts_per_token", "prefill_step_size", "routing",
                    "layer_paths", "guard_every", "int8_products")
POOL_BYTES = 2**30  # at most this much weight a kernel measurement holds (a stack of experts: 256 MiB)
DECODE_TOKENS = 24
REPLICA_PROMPT = 1024  # longer prompts: the replica's prefill rate at this many tokens


def speed_dir() -> Path:
    from edge0.cache import cache_dir

    return cache_dir() / "speed"


@functools.lru_cache(maxsize=1)
def _cpu_key() -> tuple:
    from edge0.backend import kernels as bk
    from edge0.backend import timing
    from edge0.benchmark.machine import describe

    m = describe(".")  # (reads /proc/cpuinfo and the disk's sysfs: once a process)
    return (("cpu", m["cpu"]), ("flags", tuple(m["cpu_flags"])), ("mlx", timing.version()),
            ("isa", bk.isa() if bk.available() else None))


def cpu_key() -> dict:
    """What a kernel or replica measurement holds for: the CPU, the cores this process may
    run on, MLX's version and which of Edge0's kernels run."""
    key = dict(_cpu_key())
    return {"cpu": key["cpu"], "flags": list(key["flags"]), "cores": len(os.sched_getaffinity(0)),
            "mlx": key["mlx"], "isa": key["isa"]}


def cached(kind: str, key: dict, measure):
    """``measure()`` once per ``key``, kept as JSON in ``speed_dir()``."""
    digest = hashlib.sha256(json.dumps([kind, key], sort_keys=True, default=str).encode()).hexdigest()[:20]
    path = speed_dir() / f"{kind}-{digest}.json"
    if path.exists():
        try:
            return json.loads(path.read_text())["value"]
        except (ValueError, KeyError):
            pass  # a damaged entry is measured again
    value = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"kind": kind, "key": key, "value": value}, default=str))
    os.replace(tmp, path)
    return value


# ---------------------------------------------------------------- the kernels at real widths
def _quant_of(spec, module: str):
    """(bits, group) of the quantized module ``module``, by the checkpoint's config."""
    override = spec.quant_overrides.get(module)
    base = spec.quant
    if isinstance(override, dict):
        return int(override.get("bits", base.bits)), int(override.get("group_size", base.group_size))
    return base.bits, base.group_size


def products(spec, index) -> dict:
    """The quantized products one decode token makes, in the checkpoint's order: ``calls``,
    each ``("dense", [out, in], bits, group)`` (attention, shared experts, dense MLPs,
    routers, the head: every quantized weight but the embedding tables, which are gathered)
    or ``("routed", [out, in], bits, group)`` (a MoE layer's stacked expert weight, k experts
    a row); the scales' dtype, experts and k."""
    if spec.quant is None:
        return {}
    entries = {name: e for name, (_, e) in index.entries.items()}
    scale_dtype = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
    calls, dtype = [], "float32"

    def order(name):  # layer by layer, the head last
        parts = name.split(".")
        layer = next((int(p) for p in parts if p.isdigit()), 1 << 30)
        return layer, name
    for name in sorted(entries, key=order):
        e = entries[name]
        if not name.endswith(".weight") or name[: -len("weight")] + "scales" not in entries or e.dtype != "U32":
            continue
        module = name[: -len(".weight")]
        scales = entries[module + ".scales"]
        dtype = scale_dtype.get(scales.dtype, "float32")
        bits, group = _quant_of(spec, module)
        shape = [e.shape[-2], scales.shape[-1] * group]
        if spec.is_expert_key(name):
            calls.append(("routed", shape, bits, group))
        elif "embed" not in module.rsplit(".", 1)[-1]:
            calls.append(("dense", shape, bits, group))
    return {"calls": calls, "scale_dtype": dtype, "experts": spec.num_experts, "k": spec.k}


def extra_kernel_seconds(prods: dict, rprods: dict, kernels: str, rows: int = 1) -> float:
    """Seconds a step's quantized products at ``rows`` rows take on this CPU beyond the
    replica's (``rprods``): each step's made in its order as one evaluation, each product on
    weights of its own (from memory, not the CPU's caches), each routed one on k experts of
    each row drawn at random; the two steps timed in turns in one process, so that a drift of
    the machine's speed falls on both (cached per CPU)."""
    from edge0.backend import timing

    from edge0.backend import kernels as bk

    key = {**cpu_key(), "kernels": kernels, "rows": rows, "real": prods, "replica": rprods}
    if kernels == "edge0" and bk.int8_products():  # as forecast_speed set them for the plan's engine
        key["int8_products"] = True
    real, replica = cached("kernels", key, lambda: timing.step_pair_seconds(
        prods, rprods, kernels, rows, POOL_BYTES, repeats=31 if rows == 1 else 4))
    return max(0.0, real - replica)


# ---------------------------------------------------------------- the replica
def _widths(spec, prods: dict) -> tuple[int, int]:
    """(hidden, expert width) of a checkpoint: its MoE blocks' input, and the output of the
    routed stack that takes it (gate and up; fc1)."""
    hidden = spec.block_input
    return hidden, next((c[1][0] for c in prods["calls"] if c[0] == "routed" and c[1][1] == hidden), hidden)


def _replica_experts(spec, prods: dict) -> int:
    """The replica's experts: the checkpoint's, halved while its routed stacks would hold more
    than ``REPLICA_EXPERT_BYTES`` and at least 2k (and the architecture's expert groups) stay.
    A token reads k of them a layer either way, and the stacks stay far past the CPU's caches."""
    from edge0.backend import timing
    from edge0.tiny.classic import check_groups

    per = sum(timing.nbytes(c[1], c[2], c[3], 2) for c in prods["calls"] if c[0] == "routed")  # an expert, all layers
    experts = spec.num_experts
    while experts * per > REPLICA_EXPERT_BYTES and experts % 2 == 0 and experts // 2 >= max(2 * spec.k, 8):
        try:
            check_groups(spec.model_type, experts // 2, spec.k)
        except ValueError:
            break
        experts //= 2
    return experts


def replica_config(spec, raw: dict, prods: dict) -> dict:
    """make_tiny's arguments for the checkpoint's replica: its architecture, layers and k, its
    layer pattern's config keys, its widths (hidden, expert width, attention heads), fewer
    experts where its own would not fit ``REPLICA_EXPERT_BYTES``, a small vocabulary (the head's
    product is timed apart)."""
    text = raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw
    pattern = {key: text[key] for key in PATTERN_KEYS if key in text}
    heads = {key: text[key] for key in HEAD_KEYS if isinstance(text.get(key), int)}
    hidden, moe = (-(-w // 64) * 64 for w in _widths(spec, prods))  # whole quantization groups
    return {"family": spec.model_type, "layers": spec.num_layers, "experts": _replica_experts(spec, prods),
            "k": spec.k, "hidden": hidden, "moe_intermediate": moe, **heads, **pattern}


def replica_dir(rc: dict) -> Path:
    """The replica's checkpoint, built once into the speed cache."""
    from edge0.tiny import make_tiny

    digest = hashlib.sha256(json.dumps(rc, sort_keys=True).encode()).hexdigest()[:16]
    out = speed_dir() / f"replica-{rc['family']}-{digest}"
    if not (out / "config.json").exists():
        rc = dict(rc)
        speed_dir().mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="replica-", dir=speed_dir()))
        make_tiny(rc.pop("family"), tmp, overwrite=True, **rc)
        try:
            os.replace(tmp, out)
        except OSError:  # built beside us meanwhile
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return out


def replica_arm(lay) -> tuple[str, dict]:
    """The bench arm and engine settings that run the replica as the plan runs the checkpoint."""
    config = lay.config
    options = {k: getattr(config, k) for k in REPLICA_SETTINGS if getattr(config, k) is not None}
    options["layer_paths"] = list(options.get("layer_paths", ()))
    options["expert_source"] = lay.plan.source  # as the real plan resolved it (the replica always fits)
    options["direct_io"] = "off"  # the reads' cost is the drive term's
    if not options["layer_paths"]:
        del options["layer_paths"]
    arm = "staged+prerouter" if lay.on["staged"] and lay.heads is not None else "exact"
    return arm, options


def replica_seconds(lay, rc: dict, prompt_tokens: int, rounds: int = 3) -> dict:
    """The replica's decode step (1 / its median decode tok/s) and prefill of ``prompt_tokens``
    (at the prefill rate of at most ``REPLICA_PROMPT`` tokens), benchmarked as ``edge0 bench``
    runs the arm (warm, ``rounds`` rounds), and the machine's speed while it ran (``probe_ms``:
    ``timing.probe_seconds`` around its rounds)."""
    from edge0.benchmark.harness import BenchSettings, run_bench

    arm, options = replica_arm(lay)
    prompt = min(prompt_tokens, REPLICA_PROMPT)
    key = {**cpu_key(), "replica": rc, "arm": arm, "options": options, "prompt": prompt, "dtype": lay.compute_dtype,
           "measures": ["step_s", "prefill_tps", "probe_ms", "expert_bytes"]}  # an entry without them: measured anew

    def measure():
        from edge0.backend import timing

        doc = run_bench(replica_dir(rc), BenchSettings(arms=(arm,), rounds=rounds, cache="warm",
                                                       prompt_tokens=prompt, decode_tokens=DECODE_TOKENS,
                                                       compute_dtype=lay.compute_dtype, arm_options={arm: options}),
                        probe=timing.probe_seconds)
        a = doc["arms"][arm]
        return {"step_s": 1 / a["decode_tps"]["median"], "prefill_tps": a["prefill_tps"]["median"],
                "probe_ms": statistics.median(a["probe_ms"]),
                "expert_bytes": (a.get("expert_bytes_per_token") or {}).get("median") or 0.0}
    value = cached("replica", key, measure)
    return {"step_s": value["step_s"], "prefill_s": prompt_tokens / value["prefill_tps"],
            "probe_ms": value["probe_ms"], "expert_bytes": value["expert_bytes"]}


def attention_seconds(raw: dict, prompt: int, chunk: int) -> tuple[float, str | None]:
    """The prompt's attention products (softmax(q k^T) v) at the real heads, one layer: one
    chunk timed on this CPU (cached), scaled by the chunks' query x key positions. (0, why)
    where config.json does not say the heads as standard attention does."""
    from edge0.backend import timing

    text = raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw
    heads = text.get("num_attention_heads")
    if not heads or not text.get("hidden_size"):
        return 0.0, "attention's cost at the real heads not counted: config.json names no num_attention_heads"
    kv = text.get("num_key_value_heads") or heads
    dim = text.get("head_dim") or text["hidden_size"] // heads
    q0 = min(prompt, chunk, 256)
    one = cached("attention", {**cpu_key(), "heads": heads, "kv": kv, "dim": dim, "q": q0},
                 lambda: timing.attention_seconds(heads, kv, dim, q0))
    area = sum(min(chunk, prompt - s) * min(prompt, s + chunk) for s in range(0, prompt, chunk))
    return one * area / (q0 * q0), None


# ---------------------------------------------------------------- the forecast
def forecast_speed(lay, fc: dict, prompt_tokens: int = 512) -> dict:
    """Decode tok/s and the time to the first token of ``prompt_tokens`` for the laid-out
    checkpoint ``lay`` with the plan's byte forecast ``fc`` (``edge0.exec.forecast``): the
    terms, their sum and the assumptions said; ``{"unavailable": why}`` where it cannot be
    made. The kernels' thread count and integer products are put back as they were (an engine
    may run beside)."""
    from edge0.backend import core as B
    from edge0.backend import kernels as bk
    from edge0.errors import BenchArmError
    from edge0.tiny import ARCHITECTURES

    spec = lay.opened.spec
    kernels = bk.resolve(lay.config.kernels, cpu=B.is_cpu(), compute_dtype=lay.compute_dtype)
    prods = products(spec, lay.opened.index)
    if not prods:
        return {"unavailable": "the checkpoint is not quantized: the forecast times quantized products"}
    if spec.model_type not in ARCHITECTURES:
        return {"unavailable": f"no replica of {spec.model_type} can be built (edge0.tiny builds {len(ARCHITECTURES)} "
                               "architectures)"}
    threads = bk.get_threads() if kernels == "edge0" else None
    int8 = bk.int8_products() if kernels == "edge0" else None
    try:
        if threads is not None:
            bk.set_threads(len(os.sched_getaffinity(0)))  # as an engine with compute_threads 0
            bk.set_int8_products(lay.config.int8_products == "on")  # refused at open where the CPU lacks VNNI
        return _forecast(lay, fc, prompt_tokens, kernels, prods)
    except (RuntimeError, BenchArmError) as e:  # make_tiny's degenerate routing, the replica's arm failing
        return {"unavailable": f"the replica could not be measured: {str(e).splitlines()[0]}"}
    except (ValueError, TypeError, KeyError) as e:  # the checkpoint's widths refused by its model class at that size
        return {"unavailable": f"the replica at the checkpoint's widths could not be built: "
                               f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    finally:
        if threads is not None:
            bk.set_threads(threads)
            bk.set_int8_products(bool(int8))


def _forecast(lay, fc: dict, prompt_tokens: int, kernels: str, prods: dict) -> dict:
    from edge0.model.open import open_checkpoint

    spec = lay.opened.spec
    rc = replica_config(spec, lay.opened.raw, prods)
    rep = replica_seconds(lay, rc, prompt_tokens)
    rprods = products(*open_checkpoint(replica_dir(rc))[:2])

    def extra(rows):
        return extra_kernel_seconds(prods, rprods, kernels, rows)
    flush = _flush_seconds(lay, kernels, rc)
    # the replica's own copies into slots on the layers that read on demand: the reads term counts the checkpoint's
    own = rep["expert_bytes"] * _on_demand(lay) * cached("copy", cpu_key(), _copy_rate)
    compute = rep["step_s"] - own + extra(1) + flush
    reads, exposed, assumptions = _reads(lay, fc, compute, kernels)
    step = compute + exposed
    chunk = max(1, min(prompt_tokens, lay.config.prefill_step_size))
    attention, why = attention_seconds(lay.opened.raw, prompt_tokens, chunk)
    if why:
        assumptions.append(why)
    # the replica's prefill holds the attention of its prompt (at most REPLICA_PROMPT tokens), at the real
    # heads, scaled to the prompt as if it grew with the tokens: what a longer prompt's attention adds beyond
    measured = min(prompt_tokens, REPLICA_PROMPT)
    attention = max(0.0, attention - attention_seconds(lay.opened.raw, measured, chunk)[0] * prompt_tokens / measured)
    prefill = rep["prefill_s"] + extra(chunk) * prompt_tokens / chunk + attention * spec.num_layers
    prompt_reads, why = _prompt_reads(lay, prompt_tokens, fc, kernels)
    if own:
        assumptions.append(f"the replica's own copies into slots on the layers that read on demand ({own * 1e3:.1f} ms "
                           "a step: its expert bytes a token at the copy rate) taken out of its step: the reads "
                           "count the checkpoint's")
    assumptions += [
        why,
        f"the engine's own step measured on a replica (the checkpoint's architecture, {spec.num_layers} layers, "
        f"its widths (hidden {rc['hidden']}, experts' {rc['moe_intermediate']}), {rc['experts']} experts of its "
        f"{spec.num_experts}, k={spec.k}, random weights) under the same settings",
        f"the products the replica does not make as the checkpoint does (the head, the routers, other widths) "
        f"timed on Edge0's or MLX's kernels ({kernels}) with weights from memory",
        "attention at every decoder layer",
    ]
    return {"decode_tok_s": 1.0 / step, "step_ms": step * 1e3, "compute_ms": compute * 1e3,
            "prompt_tokens": prompt_tokens,
            "probe_ms": rep["probe_ms"],
            "ttft_s": prefill + prompt_reads, "terms_ms": {
                "replica_step": rep["step_s"] * 1e3, "replica_copies": own * 1e3, "kernels": extra(1) * 1e3,
                "heads_flush": flush * 1e3,
                "reads": reads * 1e3, "reads_exposed": exposed * 1e3, "prefill_replica": rep["prefill_s"] * 1e3,
                "prefill_kernels": extra(chunk) * prompt_tokens / chunk * 1e3,
                "prefill_attention": attention * spec.num_layers * 1e3, "prompt_reads": prompt_reads * 1e3},
            "kernels": kernels, "assumptions": assumptions}


def _flush_seconds(lay, kernels: str, rc: dict) -> float:
    """The heads' flush less the replica's (``rc``: its heads are the bench's warm-start ones,
    ``WIDTH`` wide, over its experts, seeing the token): their products in 8 bits on
    Edge0's kernels, as ``prerouter_flush`` edge0 makes them; 0 without staged heads or with
    another flush (its cost is then the replica's only)."""
    from edge0.backend import timing
    from edge0.loader import prerouter_mode
    from edge0.prerouter.quantized import group_of, width_of
    from edge0.prerouter.heads import WIDTH

    heads = lay.heads
    if heads is None or not lay.on["staged"] or prerouter_mode(lay.config, heads)[1] != "edge0":
        return 0.0
    group = group_of(heads)

    def one(e, width, hidden, token):
        shapes = [(e + width, hidden), (e, width)] + ([(e + width, token)] if token else [])
        return sum(cached("dense", {**cpu_key(), "kernels": kernels, "rows": 1, "dtype": "float32", "shape": s,
                                    "bits": 8, "group": group},
                          lambda s=s: timing.dense_seconds(s, 8, group, "float32", kernels, 1, POOL_BYTES))
                   for s in shapes)
    real = one(heads.experts, width_of(heads), heads.hidden, heads.token_dim)
    return len(heads.owners) * max(0.0, real - one(rc["experts"], WIDTH, rc["hidden"], rc["hidden"]))


def _drive(lay, direct: bool, kernels: str = "edge0") -> dict:
    """The drive's rates (cached per drive and CPU), the busy one while the checkpoint's step
    products (``kernels``) run, and how much longer those products take beside the reads."""
    from edge0.backend import timing
    from edge0.io_sched.drive_rate import drive_key, drive_seconds_per_byte

    index = lay.opened.index
    key = {**drive_key(Path(index.files[0])), "threads": lay.config.reader_threads, "direct": direct,
           "cpu": cpu_key(), "kernels": kernels, "measures": ["fresh", "wall", "cpu", "fresh_busy", "compute_busy"]}

    def measure():
        prods = products(lay.opened.spec, index)
        busy = (lambda: timing.step_runner(prods["calls"], prods["scale_dtype"], prods["experts"], prods["k"],
                                           kernels, 1, POOL_BYTES)) if prods else None
        return drive_seconds_per_byte(index, lay.config.reader_threads, direct, busy)
    return cached("drive", key, measure)


def _from_disk(lay) -> bool:
    """Whether the plan's reads come from the drive (else the page cache holds the checkpoint)."""
    plan = lay.plan
    return plan.direct or lay.opened.index.total_bytes + plan.planned > plan.limit


def _on_demand(lay) -> float:
    """The share of the MoE layers that decode exact (their reads on demand, on the step's path)."""
    moe = lay.opened.spec.moe_layers
    return len([l for l in moe if l not in set(lay.on["staged"])]) / max(1, len(moe))


def _copy_rate() -> float:
    """A memory copy's seconds a byte (``drive_rate.copy_seconds_per_byte``)."""
    from edge0.io_sched.drive_rate import copy_seconds_per_byte

    return copy_seconds_per_byte()


def _reads(lay, fc: dict, compute: float, kernels: str = "edge0") -> tuple[float, float, list[str]]:
    """(a token's reads, what they add to the step, assumptions). Layers decoding exact read
    on demand: the step waits for all of it. Staged layers' reads run beside the compute at
    the drive's busy rate, and the compute runs slower while they do (``compute_busy``,
    measured on the step's products beside the drive's reads), the page cache's copies taking
    their share of the cores besides; what is left of the reads when the compute ends runs at
    the idle rate."""
    if lay.plan.source == "mapping":
        return 0.0, 0.0, ["over the mapping: no reads (the checkpoint's pages in the page cache)"]
    disk, into = fc["disk_bytes_per_token"] or 0.0, fc["expert_bytes_per_token"] or 0.0
    copy = cached("copy", cpu_key(), _copy_rate)
    from_disk = _from_disk(lay)
    drive = (_drive(lay, lay.plan.direct, kernels) if from_disk
             else {"fresh": copy, "wall": copy, "cpu": copy, "fresh_busy": copy, "compute_busy": 1.0})
    copied = max(0.0, into - disk)
    reads = disk * drive["fresh"] + copied * copy
    share = _on_demand(lay)
    said = [f"reads: {disk / 2**20:.1f} MiB a token from the {'drive' if from_disk else 'page cache'} at "
            f"{1 / drive['fresh'] / 1e9:.2f} GB/s, the rate of experts read the first time (what a decode reads "
            f"from the drive neither its slots nor the expert cache held: read long before, if ever; the same "
            f"ranges read again at once: {1 / drive['wall'] / 1e9:.2f}); "
            f"{1 / drive['fresh_busy'] / 1e9:.2f} while the kernels compute; {drive['cpu'] * 1e9:.2f} CPU s a GB; "
            f"{copied / 2**20:.1f} MiB copied at {1 / copy / 1e9:.2f} GB/s"]
    if share == 1:
        return reads, reads, said
    slow = drive["compute_busy"]
    staged = reads * (1 - share)  # the staged layers' reads at the idle rate
    beside = (disk * drive["fresh_busy"] + copied * copy) * (1 - share)  # and while the kernels compute
    cores = max(1, len(os.sched_getaffinity(0)))
    # while the reads run the compute goes at 1 / slow of its idle rate; the copies' CPU is taken from it too
    slowed = compute + min(compute * slow, beside) * (1 - 1 / slow) + copied * copy * (1 - share) / cores
    left = max(0.0, 1 - slowed / beside) * staged if beside > 0 else 0.0
    said.append(f"staged layers' reads run beside the compute (issued ahead), at the drive's rate while the kernels "
                f"compute, the compute {slow:.2f}x as long while they run (measured: the step's products beside "
                f"the drive's reads) and the copies' CPU taken from its {cores} cores; what is left when the compute "
                "ends runs at the idle rate; layers decoding exact read on demand (their share of the bytes taken as "
                "their share of the MoE layers)")
    return reads, reads * share + (slowed - compute) + left, said


def _prompt_reads(lay, prompt: int, fc: dict, kernels: str) -> tuple[float, str]:
    """Over slots from the drive: every expert the prompt touches read once, at the rate of
    experts read the first time; the trace's prompt's experts where the trace has a prompt,
    else uniform routing."""
    if lay.plan.source == "mapping" or not _from_disk(lay):
        return 0.0, "the prompt's experts in memory (no reads)"
    spec, index = lay.opened.spec, lay.opened.index
    per = statistics.mean(index.layers[l].expert_bytes for l in spec.moe_layers)
    if fc.get("prompt_experts") and not str(fc.get("source", "")).startswith("assumed"):
        touched, why = fc["prompt_experts"], "the prompt's experts those of the trace's prompt"
    else:
        touched = len(spec.moe_layers) * spec.num_experts * (1 - (1 - spec.k / spec.num_experts) ** prompt)
        why = "the prompt's experts drawn uniformly (no prompt in the trace)"
    return touched * per * _drive(lay, lay.plan.direct, kernels)["fresh"], why + " (read the first time)"
