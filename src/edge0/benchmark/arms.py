"""Benchmark arms: what runs inside one arm's process.

An arm opens the checkpoint its own way and returns a ``Loaded`` (the model and how to
read its I/O counters); the common loop then replays the same token sequence for every
arm: prefill the prompt, then feed the recorded continuation one token per step
(teacher forcing), timing each step and evaluating it fully before the next.

Later arms (hot, staged+oracle, staged+prerouter) register here with ``@arm(name)`` and
the harness runs them without change.
"""

from __future__ import annotations

import hashlib
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from edge0.benchmark.machine import proc_read_bytes

ArmFactory = Callable[[str, dict], "Loaded"]
ARMS: dict[str, ArmFactory] = {}
BASELINE = "resident"


@dataclass
class Loaded:
    model: object
    read_bytes: Callable[[], int] = lambda: 0
    read_seconds: Callable[[], float] = lambda: 0.0
    close: Callable[[], None] = lambda: None
    info: dict = field(default_factory=dict)
    disk_bytes: Callable[[], int] | None = None  # of read_bytes, those read from the disk (None: all)


def arm(name: str):
    def register(factory: ArmFactory) -> ArmFactory:
        ARMS[name] = factory
        return factory
    return register


@arm("resident")
def resident(model_dir: str, settings: dict) -> Loaded:
    """mlx-lm's resident model as a user tuned for this backend runs it: every weight loaded
    (``mlx_lm.utils.load_model``) and every floating parameter cast to the compute dtype,
    the experts' scales and biases included (as ``tests/test_families.py``'s reference), then
    evaluated, all before the timed region. Leaving the expert scales in bf16 under float32
    activations would make MLX promote the whole 256-expert scale and bias stacks on every
    ``gather_qmm`` call, a cost that is the baseline's set-up, not the model's."""
    from edge0.backend import core as B
    from edge0.backend import nn as bnn

    from edge0.backend import kernels as bk
    from edge0.exec.rows import resolve_threads

    model = bnn.load_full_model(model_dir)
    bnn.cast_model(model, B.dtype(settings["compute_dtype"]))
    B.eval(model.parameters())
    info = {"cast": f"every float to {settings['compute_dtype']}, expert scales and biases included",
            "kernels": "mlx"}
    options = settings.get("arm_options", {}).get(settings.get("arm", ""), {})
    if options.get("kernels", "mlx") == "edge0":  # resident@edge0: mlx-lm's model on Edge0's kernels
        bk.set_threads(resolve_threads(options.get("compute_threads", 0)))
        if not bk.set_int8_products(options.get("int8_products", "off") == "on"):
            raise RuntimeError("int8_products=on: this CPU has no AVX-512 VNNI")
        bk.use_edge0(model)
        model = PromptAttention(model)  # the prompt's attention too, as Edge0's engine computes it
        info["kernels"] = bk.describe()
    return Loaded(model, info=info)


class PromptAttention:
    """mlx-lm's model whose passes compute as Edge0's engine computes them on its kernels
    (``resident@edge0``): norms and rotary embeddings on Edge0's row kernels, and a prompt's
    attention (more than one token) on Edge0's attention kernel; decode steps' attention on
    MLX's."""

    def __init__(self, model):
        self.model = model

    def __call__(self, inputs, *args, **kwargs):
        from edge0.backend import kernels as bk

        with bk.attention.active(True):
            return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def base_arm(name: str) -> str:
    """``staged+prerouter@narrow`` -> ``staged+prerouter``: a variant runs its base arm with
    the engine settings ``--arm-option`` gives it."""
    return name.split("@", 1)[0]


def engine_config(settings: dict, **paths):
    from edge0.config import EngineConfig

    keys = ("bundle_capacity", "reader_threads", "slots_per_layer", "prefetch_depth", "hot_experts")
    if settings.get("cache_budget_mb") is not None:  # bench --cache-budget-mb: every Edge0 arm's expert cache
        paths.setdefault("cache_mb", settings["cache_budget_mb"])
    paths.setdefault("prerouter", "off")  # only the prerouter arm uses heads, even if the model has them
    paths.setdefault("adapter", "off")  # likewise adapters: an arm names its own (--arm-option ARM:adapter=DIR)
    paths.setdefault("kernels", settings.get("kernels", "auto"))  # bench --kernels; an arm may name its own
    paths.update(settings.get("arm_options", {}).get(settings.get("arm", ""), {}))
    return EngineConfig(compute_dtype=settings["compute_dtype"], **{k: settings[k] for k in keys if k in settings},
                        **paths)


def _streaming(model_dir: str, settings: dict, oracle=None, **paths) -> Loaded:
    from edge0.loader import load_streaming_model
    from edge0.streaming import StepModel

    cfg = engine_config(settings, **paths)
    s = load_streaming_model(model_dir, cfg, oracle=oracle)
    if s.stager is not None:
        s.stager.reset()
    stall = (lambda: s.stager.stats().stall_seconds) if s.stager is not None else (lambda: s.reader.stats.seconds)
    info = {k: getattr(cfg, k) for k in ("bundle_capacity", "slots_per_layer", "prefetch_depth", "hot_experts",
                                         "reader_threads")}
    info["experts_per_token"] = s.spec.k
    info["kernels"] = s.kernels_label  # which kernels computed the quantized matmuls
    info["direct_reads"] = s.reader.direct  # direct_io's outcome (auto: on under a cap below the checkpoint)
    bank = s.adapters
    info["adapter_bytes"] = bank.nbytes if bank is not None and bank.active is not None else 0
    cache = s.reader.cache
    info["expert_cache"] = f"{cache.name}, {cache.budget / 2**20:.0f} MiB" if cache is not None else None
    info["expert_source"] = s.plan.source  # slots, or the checkpoint's mapping (nothing read into buffers)
    stats = s.reader.stats  # the expert bytes put into buffers: read from the disk, or copied from the cache
    # over the mapping, what the disk gave this process (its page faults) is its kernel counter's
    disk = proc_read_bytes if s.plan.source == "mapping" else (lambda: stats.bytes)
    return Loaded(StepModel(s), lambda: stats.bytes + stats.cache_bytes, stall, s.close, info=info, disk_bytes=disk)


def _oracle(settings: dict):
    from edge0.exec.oracle import OracleRouting

    if "oracle_file" not in settings:
        raise RuntimeError("staged arms need the harness's recorded oracle (settings['oracle_file'])")
    return OracleRouting.load(settings["oracle_file"])


@arm("exact")
def exact(model_dir: str, settings: dict) -> Loaded:
    """Edge0's exact streaming path: experts read on demand every step."""
    return _streaming(model_dir, settings)


@arm("hot")
def hot(model_dir: str, settings: dict) -> Loaded:
    """Per-layer LRU hot sets of ``hot_experts``; misses read on demand."""
    return _streaming(model_dir, settings, decode_path="hot")


@arm("staged+oracle")
def staged_oracle(model_dir: str, settings: dict) -> Loaded:
    """Staged decode with the recorded true routing: reads scheduled before each step.
    The read-wait figure is the time compute waited on slots (stalls)."""
    return _streaming(model_dir, settings, oracle=_oracle(settings), decode_path="staged")


@arm("staged+prerouter")
def staged_prerouter(model_dir: str, settings: dict) -> Loaded:
    """Prediction as routing: heads predict every consumer layer's routing one token ahead;
    the prediction is the routing and plans the reads. The read-wait figure is the stall."""
    if "prerouter_file" not in settings:
        raise RuntimeError("the staged+prerouter arm needs settings['prerouter_file']")
    options = settings.get("arm_options", {}).get(settings.get("arm", ""), {})
    return _streaming(model_dir, settings, prerouter="on",
                      **({} if "prerouter_file" in options else {"prerouter_file": settings["prerouter_file"]}))


@arm("llama.cpp")
def llama_cpp_arm(model_dir: str, settings: dict) -> Loaded:
    """llama.cpp's own decode of the checkpoint converted to GGUF (``edge0.benchmark.llama_cpp``);
    it has a replay of its own, not an MLX model."""
    raise RuntimeError("the llama.cpp arm replays through edge0.benchmark.llama_cpp.replay")


class _NoReads:
    def read(self, layer, expert, slot):
        return 0


@arm("compute-only")
def compute_only(model_dir: str, settings: dict) -> Loaded:
    """The staged computation with reads switched off (slots keep whatever they hold):
    the compute floor of a staged step, measured in the same run. Its experts are in slots
    even where the checkpoint fits (a mapping has no reads to switch off)."""
    loaded = _streaming(model_dir, settings, oracle=_oracle(settings), decode_path="staged", expert_source="slots")
    stager = loaded.model.streaming.stager
    stager.scheduler.store = _NoReads()
    stager.check_routing = False  # unread slots give other activations, hence other routing
    loaded.info["reads"] = "off"
    return loaded


@arm("read-only")
def read_only(model_dir: str, settings: dict) -> Loaded:
    """The staged step's reads with no compute: the scheduler fills the slots for each
    step's plan; a "step" is done when every layer is ready (into slots even where the
    checkpoint fits)."""
    return _streaming(model_dir, settings, oracle=_oracle(settings), decode_path="staged", expert_source="slots")


def _read_only_step(model) -> None:
    stager = model.streaming.stager
    stager.advance_step()
    stager.wait_planned()


def record_oracle(model_dir: str, prompt: list[int], continuation: list[int], path: str) -> int:
    """Record the exact path's routing over the replay sequence (prefill, then one token
    per step), the oracle the staged arms replay. Returns the number of steps."""
    from edge0.backend import core as B
    from edge0.backend import nn as bnn
    from edge0.config import EngineConfig
    from edge0.loader import load_streaming_model
    from edge0.streaming import StepModel

    s = load_streaming_model(model_dir, EngineConfig(), record=True)
    try:
        model = StepModel(s)
        cache = bnn.make_cache(model)
        B.eval(model(B.array([prompt]), cache=cache))
        for token in continuation:
            B.eval(model(B.array([[token]]), cache=cache))
        routing = s.recorder.routing(model_dir)
        routing.save(path)
        return len(routing)
    finally:
        s.close()


def tokens_digest(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def replay(name: str, model_dir: str, prompt: list[int], continuation: list[int], settings: dict) -> dict:
    """Run arm ``name`` over the replay sequence; returns its figures (one JSON object)."""
    if base_arm(name) == "llama.cpp":
        from edge0.benchmark import llama_cpp

        result = llama_cpp.replay(name, prompt, continuation, dict(settings, arm=name))
        return dict(result, consumed_digest=tokens_digest(prompt + continuation),
                    argmax_digest=tokens_digest(result.pop("argmax")))
    from edge0.backend import core as B
    from edge0.backend import nn as bnn
    from edge0.stats import peak_rss_bytes

    B.reset_peak_memory()
    t0 = time.perf_counter()
    settings = dict(settings, arm=name)
    loaded = ARMS[base_arm(name)](model_dir, settings)
    load_seconds = time.perf_counter() - t0
    try:
        model = loaded.model
        cache = bnn.make_cache(model)
        bytes0, wait0 = loaded.read_bytes(), loaded.read_seconds()
        t0 = time.perf_counter()
        logits = model(B.array([prompt]), cache=cache)
        B.eval(logits)
        prefill_seconds = time.perf_counter() - t0
        prefill_bytes = loaded.read_bytes() - bytes0
        argmax = [int(logits[0, -1].argmax().item())]
        steps, step_bytes, step_waits, step_disk = [], [], [], []
        disk = loaded.disk_bytes or loaded.read_bytes
        usage0 = resource.getrusage(resource.RUSAGE_SELF)
        for token in continuation:
            b, w, d = loaded.read_bytes(), loaded.read_seconds(), disk()
            t0 = time.perf_counter()
            if base_arm(name) == "read-only":
                _read_only_step(model)
            else:
                logits = model(B.array([[token]]), cache=cache)
                B.eval(logits)
            steps.append(time.perf_counter() - t0)
            step_bytes.append(loaded.read_bytes() - b)
            step_waits.append(loaded.read_seconds() - w)
            step_disk.append(disk() - d)
            if base_arm(name) not in ("read-only", "compute-only"):
                argmax.append(int(logits[0, -1].argmax().item()))
        decode_seconds = sum(steps)
        usage = resource.getrusage(resource.RUSAGE_SELF)  # the decode steps' CPU: user and system (reads)
        loaded.info.update(decode_user_s=usage.ru_utime - usage0.ru_utime,
                           decode_system_s=usage.ru_stime - usage0.ru_stime)
        return dict(
            arm=name, settings=settings, info=loaded.info, load_seconds=load_seconds,
            prompt_tokens=len(prompt), decode_tokens=len(continuation),
            consumed_digest=tokens_digest(prompt + continuation), argmax_digest=tokens_digest(argmax),
            prefill_tps=len(prompt) / prefill_seconds, decode_tps=len(continuation) / decode_seconds,
            step_ms=[s * 1e3 for s in steps], step_ms_median=1e3 * sorted(steps)[len(steps) // 2],
            read_wait_ms_per_step=1e3 * sum(step_waits) / len(steps),
            expert_bytes_per_token=sum(step_bytes) / len(steps), disk_bytes_per_token=sum(step_disk) / len(steps),
            prefill_expert_bytes=prefill_bytes,
            peak_active_memory=B.peak_memory(), peak_rss=peak_rss_bytes(),
            total_wait_ms=1e3 * (loaded.read_seconds() - wait0),
        )
    finally:
        loaded.close()


def main() -> int:
    """Child-process entry: ``python -m edge0.benchmark.arms JOB.json`` prints one JSON line."""
    job = json.loads(open(sys.argv[1], encoding="utf-8").read())
    if job.get("warm_heads"):
        from edge0.train.heads import make_warm_heads

        make_warm_heads(job["model"], job["warm_heads"])
        print(json.dumps({"warm_heads": job["warm_heads"]}))
        return 0
    if job.get("record_oracle"):
        n = record_oracle(job["model"], job["prompt"], job["continuation"], job["record_oracle"])
        print(json.dumps({"oracle_steps": n}))
        return 0
    result = replay(job["arm"], job["model"], job["prompt"], job["continuation"], job["settings"])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
