"""``edge0 plan``: what opening a checkpoint will hold, and what it will read, before loading.

    edge0 plan [--model DIR] [--memory 8G] [--plan-context 4096 --plan-batch 1] [--trace FILE]
               [--speed [--prompt-tokens 512]] [--json]

Reads config.json and the weight files' headers (no tensor byte of the checkpoint; the
prerouter heads beside it are loaded, as the plan counts them) and makes the memory plan
``Engine.open`` makes (``edge0.loader.lay_out``, ``edge0.exec.budget.plan_memory``): the
process itself, the resident weights, the expert buffers at open and their ceiling, the KV
budget, the expert cache and the margin, within the memory the process may use (``--memory``
plans for another limit, say the cgroup an application will run in). A plan that cannot fit
is refused with the error ``Engine.open`` would raise. Then the forecast: the disk's bytes per
token, replaying a recorded routing trace through the plan's slots and cache
(``edge0.exec.forecast``): ``--trace``, else ``routing-trace.json`` beside the checkpoint
(``edge0 record-routing --out DIR/routing-trace.json``), else a stated assumption (each step's
experts drawn uniformly at random). ``--speed`` adds decode tok/s and the time to the first
token of a ``--prompt-tokens`` prompt on this machine (``edge0.speed``: the drive, the kernels
and a tiny replica of the checkpoint measured once, cached).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TRACE_FILENAME = "routing-trace.json"
ASSUMED_STEPS = 64  # the uniform assumption's trace: this many decode steps ...
ASSUMED_PROMPT = 32  # ... after a prompt of this many tokens


def limit_source(memory: int | None) -> str:
    """Where the memory limit comes from."""
    from edge0.io_sched import direct as dio

    if memory is not None:
        return "--memory"
    parts = {"physical memory": dio.physical_memory(), "cgroup limit": dio.cgroup_limit(),
             "rlimit": dio.rlimit_memory()}
    return min((v, k) for k, v in parts.items() if v)[1]


def assumed_trace(layers: list[int], num_experts: int, k: int, seed: int = 0) -> OracleRouting:
    """Routing drawn uniformly at random: each layer's k experts of each step, and of each
    prompt token (one chunk)."""
    from edge0.exec.oracle import OracleRouting

    rng = random.Random(seed)

    def draw(tokens: int) -> dict[int, tuple[int, ...]]:
        return {l: tuple(sorted({e for _ in range(tokens) for e in rng.sample(range(num_experts), k)}))
                for l in layers}

    return OracleRouting([draw(1) for _ in range(ASSUMED_STEPS)], prefill=[draw(ASSUMED_PROMPT)])


def make(model_dir: str | Path, config, *, memory: int | None = None, trace: str | Path | None = None,
         runtime: int | None = None, speed: int | None = None) -> dict:
    """The plan and the forecast of ``model_dir`` under ``config``, as a dict (``--json``);
    ``speed``: also the speed forecast (``edge0.speed``) with the time to the first token of a
    prompt of that many tokens."""
    from edge0.exec.forecast import forecast
    from edge0.exec.oracle import OracleRouting
    from edge0.loader import lay_out

    model_dir = Path(model_dir)
    lay = lay_out(model_dir, config, limit=memory, runtime=runtime)
    plan, spec, index = lay.plan, lay.opened.spec, lay.opened.index
    trace_path = Path(trace) if trace else model_dir / TRACE_FILENAME
    if trace is not None or trace_path.exists():
        routing = OracleRouting.load(trace_path)
        routing.check(spec.moe_layers, spec.num_experts)
        source = f"trace {trace_path} ({len(routing.steps)} decode steps)"
    else:
        routing = assumed_trace(lay.layers, spec.num_experts, spec.k)
        source = (f"assumed: each step's {spec.k} experts of a layer drawn uniformly at random, a "
                  f"{ASSUMED_PROMPT}-token prompt first (no {TRACE_FILENAME} beside the checkpoint)")
    staged = set(lay.on["staged"])
    width = spec.k + lay.extra
    fc = forecast(routing, staged=staged, slots=plan.slots, capacity=plan.cache // max(1, plan.per_expert),
                  policy=plan.policy,
                  expert_bytes={l: index.layers[l].expert_bytes for l in lay.layers if l not in lay.on["resident"]},
                  scale=width / spec.k)
    doc = {"model": str(model_dir), "model_type": spec.model_type, "moe_layers": len(lay.layers),
            "experts": spec.num_experts, "k": spec.k, "staged_layers": len(staged), "routing": lay.routing,
            "stage_extra": lay.extra, "over_memory_routing": lay.over_memory_routing,
            "compute_dtype": lay.compute_dtype,
            "prefetch_depth": lay.config.prefetch_depth if staged else None,
            "limit_source": limit_source(memory), "plan": _plan_dict(plan),
            "forecast": {**fc, "source": source}}
    if speed is not None:
        from edge0.speed import forecast_speed

        doc["speed"] = forecast_speed(lay, doc["forecast"], prompt_tokens=speed)
    return doc


def _plan_dict(plan) -> dict:
    out = dict(plan.__dict__)
    for name in ("slots_bytes", "ceiling_bytes", "kv_bytes", "at_open", "planned"):
        out[name] = getattr(plan, name)
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:7.2f} GiB" if n >= 2**30 else f"{n / 2**20:7.1f} MiB"


def text(doc: dict) -> str:
    """The plan as ``edge0 plan`` prints it."""
    p, f = doc["plan"], doc["forecast"]
    mapped = p["source"] == "mapping"
    routing = doc["routing"] + (f" (+{doc['stage_extra']} staged)" if doc["stage_extra"] else "")
    if doc.get("over_memory_routing"):
        routing += ", the heads file's choice for a checkpoint larger than the memory"
    lines = [
        f"model: {doc['model']} ({doc['model_type']}, {doc['moe_layers']} MoE layers x {doc['experts']} experts, "
        f"k={doc['k']}; {doc['staged_layers']} decode staged, routing {routing}; compute {doc['compute_dtype']})",
        f"memory the process may use {_gib(p['limit'])}  ({doc['limit_source']})",
        f"  the process itself       {_gib(p['runtime'])}  (measured now: interpreter, MLX, mlx-lm)",
        f"  resident weights         {_gib(p['resident'])}  (every tensor but the routed experts, in the compute "
        "dtype)",
        f"  prerouter heads          {_gib(p['heads'])}  (as the prerouter holds them)",
        f"  expert buffers at open   {_gib(p['others'] + p['slots_bytes'])}  "
        + ("(none: expert_source mapping, the kernels read each expert where the checkpoint's mapping holds it)"
           if mapped else f"({p['staged']} staged layers x {p['slots']} slots, the exact bundle, "
                          + (f"{p['whole_layers']} unpredicted layer{'s' * (p['whole_layers'] > 1)} held whole, "
                             if p["whole_layers"] else "") + "hot sets, whole-layer buffers)"),
        *([] if mapped else [f"  slots grown for a batch  {_gib(p['ceiling_bytes'] - p['slots_bytes'])}  (up to "
                             f"{p['ceiling']} slots a staged layer)"]),
        f"  KV caches                {_gib(p['kv_bytes'])}  ({p['batch']} x {p['context']} tokens, "
        f"{p['kv_per_token'] / 1024:.1f} KiB a token{'; ' + p['kv_note'] if p['kv_note'] else ''})",
        f"  expert cache             {_gib(p['cache'])}  ({p['policy']}, {p['cache'] / max(1, p['held']):.0%} of the "
        f"{_gib(p['held']).strip()} of experts; {'direct' if p['direct'] else 'buffered'} reads)",
        f"  margin                   {_gib(p['margin'])}  (activations, MLX's buffer cache; left unplanned)",
        f"  planned in all           {_gib(p['planned'])}",
    ]
    if mapped:
        lines.append(f"  + mapped checkpoint      {_gib(p['mapped'])}  (its files, held by the page cache: they fit "
                     "beside the plan, so experts are computed in place)")
    if doc["prefetch_depth"] and not mapped:
        lines.append(f"prefetch depth {doc['prefetch_depth']}: reads run up to {doc['prefetch_depth']} staged layers "
                     "ahead of compute, into the slots above (no memory of its own)")
    if mapped:
        lines.append("forecast: no expert reads (0 MiB/token into buffers); the first pass over an expert not in the "
                     "page cache faults its pages in from the disk")
    elif f["disk_bytes_per_token"] is not None:
        source = "from the disk" if p["direct"] else "read (buffered: the page cache may hold them)"
        lines.append(f"forecast: {f['disk_bytes_per_token'] / 2**20:.1f} MiB/token {source}, "
                     f"{f['expert_bytes_per_token'] / 2**20:.1f} MiB/token of experts into the slots; "
                     f"{f['source']}")
    if doc.get("speed"):
        lines += speed_lines(doc["speed"])
    return "\n".join(lines)


def speed_lines(sp: dict) -> list[str]:
    """The speed forecast as ``edge0 plan --speed`` prints it."""
    if sp.get("unavailable"):
        return [f"speed forecast: none ({sp['unavailable']})"]
    t = sp["terms_ms"]
    return [f"speed forecast on this machine: {sp['decode_tok_s']:.2f} tok/s decode (a step {sp['step_ms']:.1f} ms: "
            f"the engine's own {t['replica_step']:.1f} + the kernels at the real widths {t['kernels']:.1f} + the "
            f"heads' flush {t['heads_flush']:.1f} + reads "
            f"waited for {t['reads_exposed']:.1f} of {t['reads']:.1f}); time to the first token of a "
            f"{sp['prompt_tokens']}-token prompt {sp['ttft_s']:.2f} s (the engine's own {t['prefill_replica'] / 1e3:.2f}"
            f" + the kernels {t['prefill_kernels'] / 1e3:.2f} + attention {t['prefill_attention'] / 1e3:.2f} + reads "
            f"{t['prompt_reads'] / 1e3:.2f})",
            *(f"  assumed: {a}" for a in sp["assumptions"])]


def add_parser(sub, default_model) -> None:
    """``edge0 plan``; ``default_model()``: the model planned without ``--model``."""
    from edge0.config_sources.cli_flags import add_config_flags

    p = sub.add_parser("plan", help="what opening a checkpoint will hold and read, before loading (headers only)",
                       description="Reads config.json and the weight files' headers (no tensor byte of the checkpoint; "
                                   "the prerouter heads beside it are loaded) and prints "
                                   "the memory plan Engine.open makes: the process itself, the resident weights, "
                                   "the expert buffers, the KV budget, the expert cache and the margin, within the "
                                   "memory the process may use (or --memory); refuses a plan that cannot fit as "
                                   "Engine.open would. Then the disk's bytes per token forecast from a recorded "
                                   f"routing trace (--trace, else {TRACE_FILENAME} beside the checkpoint, else "
                                   "uniform routing assumed). Takes every engine setting.")
    p.add_argument("--model", default=None,
                   help="a checkpoint directory or a cached repo id (default: the built-in demo model)")
    p.add_argument("--memory", default=None, metavar="SIZE",
                   help="plan for this much memory (8G, 512M) instead of what this process may use")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help=f"routing recorded by `edge0 record-routing --out` (default: {TRACE_FILENAME} beside the "
                        "checkpoint, else uniform routing assumed)")
    p.add_argument("--speed", action="store_true",
                   help="also forecast decode tok/s and the time to the first token on this machine (measures the "
                        "drive, the kernels and a tiny replica of the checkpoint once, cached: a minute or two the "
                        "first time)")
    p.add_argument("--prompt-tokens", type=int, default=512, metavar="N",
                   help="the prompt length whose time to the first token --speed forecasts (default 512)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_config_flags(p)
    p.set_defaults(func=cmd_plan, default_model=default_model)


def cmd_plan(args) -> int:
    from edge0.benchmark.cgroup import parse_size
    from edge0.config_sources.resolve import resolve_config
    from edge0.hub import resolve_model

    from edge0.errors import ConfigError

    memory = parse_size(args.memory, "--memory") if args.memory is not None else None
    if args.prompt_tokens < 1:
        raise ConfigError(f"--prompt-tokens must be at least 1, got {args.prompt_tokens}")
    model = resolve_model(args.model) if args.model is not None else args.default_model()
    doc = make(model, resolve_config(args), memory=memory, trace=args.trace,
               speed=args.prompt_tokens if args.speed else None)
    print(json.dumps(doc, indent=1) if args.json else text(doc))
    return 0
