"""The same-session A/B harness.

Protocol (the paper's): each arm runs in its own process; the arm order rotates every
round; every arm replays the same token sequence (a prompt, then a continuation sampled
once by the exact path and fed back token by token); the checkpoint's page cache is
evicted (``posix_fadvise(DONTNEED)``) or warmed (read through) before each run; arms with
an expert cache get the same budget; every figure is the median over rounds, with its
spread (min..max). Ratios are arm median / resident median.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from edge0.benchmark import machine
from edge0.benchmark.arms import ARMS, BASELINE, base_arm
from edge0.child_python import python_code, python_module
from edge0.errors import BenchArmError, ConfigError

SCHEMA_VERSION = 2  # 2: the machine it ran on
FIGURES = ("decode_tps", "step_ms_median", "prefill_tps", "peak_active_memory", "peak_rss", "expert_bytes_per_token",
           "disk_bytes_per_token", "read_wait_ms_per_step", "load_seconds")
CACHE_MODES = ("cold", "warm")
PROMPT_TEXT = ("import os\nimport sys\n\n\ndef read_config(path):\n    \"\"\"Read a JSON config file.\"\"\"\n"
               "    with open(path) as f:\n        return json.load(f)\n\n\nclass Cache:\n    def __init__(self):\n")


@dataclass
class BenchSettings:
    arms: tuple[str, ...] = ("resident", "exact")
    rounds: int = 3
    cache: str = "cold"
    prompt_tokens: int = 32
    decode_tokens: int = 16
    compute_dtype: str = "float32"
    cache_budget_mb: int | None = None  # expert cache per arm that has one (same for all)
    memory_limit: int | None = None  # bytes: each arm's process runs in a memory cgroup capped at this
    arm_options: dict = field(default_factory=dict)  # arm name -> EngineConfig values (variants: ARM@label)
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        unknown = [a for a in self.arms if base_arm(a) not in ARMS]
        if unknown:
            raise ConfigError(f"unknown arm(s) {unknown}; available: {sorted(ARMS)}")
        if self.cache not in CACHE_MODES:
            raise ConfigError(f"cache must be one of {CACHE_MODES}, got {self.cache!r}")
        for name in ("rounds", "prompt_tokens", "decode_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if LLAMA_CPP in {base_arm(a) for a in self.arms}:
            from edge0.benchmark.llama_cpp import available

            missing = available()
            if missing:
                raise ConfigError(missing)

    def arm_settings(self) -> dict:
        s = {"compute_dtype": self.compute_dtype, "arm_options": self.arm_options, **self.extra}
        if self.cache_budget_mb is not None:
            s["cache_budget_mb"] = self.cache_budget_mb
        return s


def checkpoint_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("model*.safetensors"))


def evict(files: list[Path]) -> None:
    """Drop the files' pages from the page cache (clean pages only; these are read-only)."""
    from edge0.io_sched.direct import drop_cached

    drop_cached(files, strict=True)


def warm(files: list[Path]) -> None:
    """Read every byte once so the files sit in the page cache."""
    buf = bytearray(16 * 2**20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def rotation(arms: tuple[str, ...], round_index: int) -> list[str]:
    k = round_index % len(arms)
    return list(arms[k:] + arms[:k])


def make_replay(model_dir: Path, prompt_tokens: int, decode_tokens: int, seed: int = 0) -> dict:
    """The token sequence every arm replays: a fixed prompt, then a continuation sampled
    once (temperature 0.8) with the exact path. Runs in a child process."""
    code = (
        "import json,sys\n"
        "from edge0 import Engine\n"
        "d, n_prompt, n_decode, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])\n"
        "with Engine(d) as e:\n"
        f"    ids = e.encode({PROMPT_TEXT!r} * 64)[:n_prompt]\n"
        "    cont = [ev.token for ev in e.stream(ids, max_tokens=n_decode, temp=0.8, seed=seed)]\n"
        "print(json.dumps({'prompt': ids, 'continuation': cont, 'seed': seed}))\n"
    )
    out = subprocess.run(python_code(code, str(model_dir), str(prompt_tokens), str(decode_tokens), str(seed)),
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"sampling the replay sequence failed:\n{out.stderr[-2000:]}")
    replay = json.loads(out.stdout.strip().splitlines()[-1])
    if len(replay["prompt"]) < prompt_tokens:
        raise ConfigError(f"the prompt text tokenizes to only {len(replay['prompt'])} tokens")
    # the continuation may stop early at EOS; pad by repeating it so every arm gets n steps
    cont = replay["continuation"] or [0]
    replay["continuation"] = (cont * (decode_tokens // len(cont) + 1))[:decode_tokens]
    return replay


STAGED_ARMS = ("staged+oracle", "compute-only", "read-only")
LLAMA_CPP = "llama.cpp"


def default_gguf(model_dir: Path) -> Path:
    """Where the llama.cpp arm's GGUF copy of ``model_dir`` is kept (converted once): named
    by the checkpoint's config and its files' names, sizes and times."""
    import hashlib

    from edge0.cache import cache_dir

    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in checkpoint_files(model_dir):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return cache_dir() / "gguf" / f"{model_dir.name}-{h.hexdigest()[:12]}.q4_1.gguf"


def _gguf_for(model_dir: Path, arm_settings: dict, progress) -> Path:
    from edge0.benchmark.to_gguf import convert

    path = Path(arm_settings.get("gguf_file") or default_gguf(model_dir))
    if not path.exists():
        progress(f"converting the checkpoint to GGUF for the llama.cpp arm: {path.name}")
        path.parent.mkdir(parents=True, exist_ok=True)
        convert(model_dir, path, progress)
    return path


_CAPS = iter(range(1 << 30))


def _child(job: dict, memory_limit: int | None = None, source: str | None = None) -> dict:
    """Run one job in its own process (in a memory cgroup capped at ``memory_limit``
    bytes, if given), on the Edge0 of the source tree ``source`` when given (another
    checkout: an A/B of two versions in one run). An arm the kernel kills for memory is a
    result: ``{"out_of_memory": True, "memory_cap": {...}}``."""
    cap = None
    if memory_limit is not None:
        from edge0.benchmark.cgroup import MemoryCap

        cap = MemoryCap(memory_limit, f"edge0-bench-{os.getpid()}-{next(_CAPS)}")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    returncode, info = 0, None
    try:
        join = cap.prepare() if cap is not None else None
        command = python_module("edge0.benchmark.arms", f.name) if source is None else \
            [sys.executable, "-P", "-c", SOURCE_RUNNER, source, f.name]
        out = subprocess.run(command, capture_output=True, text=True, preexec_fn=join)
        returncode = out.returncode
    finally:
        os.unlink(f.name)
        if cap is not None:
            info = cap.finish(returncode)
    if info is not None and info["oom_killed"]:
        return {"out_of_memory": True, "memory_cap": info}
    if out.returncode:
        raise arm_failed(job.get("arm") or "oracle recording", out.returncode, out.stderr)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if info is not None:
        result["memory_cap"] = info
    return result


def record_oracle(model_dir: Path, replay: dict, path: Path) -> int:
    """The staged arms' oracle: the exact path's routing over the replay sequence."""
    return _child({"record_oracle": str(path), "model": str(model_dir), "prompt": replay["prompt"],
                   "continuation": replay["continuation"]})["oracle_steps"]


# an arm's process on another source tree: that tree's edge0 first on the path, then its arm runner
# what to do when an arm dies by a signal
CRASHES = {
    signal.SIGILL: "an instruction this CPU does not run: a build for another CPU, or llama.cpp's AMX tiles, "
                   "which virtual machines may report but not run; rebuild llama-cpp-python without them "
                   "(docs/BENCHMARKS.md, \"llama.cpp built for this CPU\")",
    signal.SIGKILL: "killed from outside: the kernel's out-of-memory killer (no --memory-limit cgroup caught it) "
                    "or another process",
    signal.SIGSEGV: "a crash inside the process (a native library's fault)",
    signal.SIGBUS: "a mapped file's pages could not be read (the checkpoint or GGUF file changed or its disk failed)",
    signal.SIGABRT: "the process aborted (a native library's assertion)",
}


def arm_failed(arm: str, returncode: int, stderr: str) -> BenchArmError:
    """The error of an arm's process that failed: its exit status, or the signal that ended
    it and what that usually means, and the end of what it printed (or that it printed nothing)."""
    said = stderr.strip()[-3000:] or "(it printed nothing on stderr)"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        why = CRASHES.get(-returncode, "ended by a signal")
        return BenchArmError(f"{arm} was ended by {name}: {why}\n{said}", arm, returncode)
    return BenchArmError(f"{arm} failed (exit status {returncode}):\n{said}", arm, returncode)


SOURCE_RUNNER = ("import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
                 "runpy.run_module('edge0.benchmark.arms', run_name='__main__', alter_sys=True)")


def run_arm_process(name: str, model_dir: Path, replay: dict, settings: dict, memory_limit: int | None = None) -> dict:
    """One run of arm ``name``; the arm's ``source`` option (not an engine setting) names the
    source tree it runs on."""
    options = dict(settings.get("arm_options", {}).get(name, {}))
    source = options.pop("source", None)
    if source is not None:
        settings = {**settings, "arm_options": {**settings["arm_options"], name: options}}
    return _child({"arm": name, "model": str(model_dir), "prompt": replay["prompt"],
                   "continuation": replay["continuation"], "settings": settings}, memory_limit, source)


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def run_bench(model_dir: str | Path, settings: BenchSettings, progress: Callable[[str], None] = lambda s: None,
              runner=run_arm_process, forecaster=None, probe=None) -> dict:
    """Run every arm ``settings.rounds`` times in rotating order; returns the result document.
    ``forecaster(model_dir, settings, arm_settings, progress)``: forecasts made before the
    rounds (arm name -> forecast, kept in the arm's document), once the replay's oracle and
    the heads are written. ``probe()``: seconds of a fixed step of products, timed in this
    process before and after each round (an arm's ``probe_ms``, a round each: the machine's
    speed while it ran)."""
    settings.validate()
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    if not files:
        raise ConfigError(f"{model_dir} holds no model*.safetensors")
    progress("sampling the replay sequence")
    replay = make_replay(model_dir, settings.prompt_tokens, settings.decode_tokens)
    arm_settings = settings.arm_settings()
    with tempfile.TemporaryDirectory(prefix="edge0-bench-") as tmp:
        if any(base_arm(a) in STAGED_ARMS for a in settings.arms) or forecaster is not None:
            progress("recording the oracle routing of the replay sequence")
            oracle = Path(tmp) / "oracle.json"
            record_oracle(model_dir, replay, oracle)
            arm_settings["oracle_file"] = str(oracle)
        if any(base_arm(a) == "staged+prerouter" for a in settings.arms) and "prerouter_file" not in arm_settings:
            progress("writing warm-start prerouter heads (no --heads given)")
            heads = Path(tmp) / "prerouter.safetensors"
            _child({"warm_heads": str(heads), "model": str(model_dir)})
            arm_settings["prerouter_file"] = str(heads)
            arm_settings["heads"] = "warm start (untrained)"
        forecasts = forecaster(model_dir, settings, arm_settings, progress) if forecaster is not None else {}
        gguf = None
        if LLAMA_CPP in {base_arm(a) for a in settings.arms}:
            gguf = _gguf_for(model_dir, arm_settings, progress)
            arm_settings["gguf_file"] = str(gguf)
        runs, orders = _rounds(model_dir, files, settings, replay, arm_settings, progress, runner, gguf, probe)
    doc = _document(model_dir, files, settings, replay, runs, orders)
    if probe is not None:
        for name, arm_runs in runs.items():
            doc["arms"][name]["probe_ms"] = [r["probe_ms"] for r in arm_runs]
    for name, forecast in forecasts.items():
        doc["arms"][name]["forecast"] = forecast
    if gguf is not None:
        doc["gguf_bytes"] = gguf.stat().st_size
    return doc


def _rounds(model_dir, files, settings, replay, arm_settings, progress, runner, gguf=None, probe=None):
    runs: dict[str, list[dict]] = {a: [] for a in settings.arms}
    orders = []
    for r in range(settings.rounds):
        order = rotation(settings.arms, r)
        orders.append(order)
        for name in order:
            reads = [gguf] if base_arm(name) == LLAMA_CPP else files  # the file(s) this arm reads
            if settings.cache == "cold":
                evict(files + ([gguf] if gguf is not None else []))
            else:
                warm(reads)
            progress(f"round {r + 1}/{settings.rounds}: {name} ({settings.cache})")
            before = probe() if probe is not None else None
            if settings.memory_limit is not None:
                result = runner(name, model_dir, replay, arm_settings, memory_limit=settings.memory_limit)
                if result.get("out_of_memory"):
                    progress(f"{name} did not run: out of memory at "
                             f"{(result['memory_cap']['peak_bytes'] or 0) / 2**20:.0f} MiB")
            else:
                result = runner(name, model_dir, replay, arm_settings)
            if probe is not None:
                result = {**result, "probe_ms": (before + probe()) / 2 * 1e3}
            runs[name].append(result)
    return runs, orders


PATH_KEYS = ("adapter", "extra_adapters", "source")  # settings that name files, besides the *_file ones


def _portable(settings: dict) -> dict:
    """Results name files by their base name, at any depth (an arm's options too): a
    document names no folder of the machine it ran on."""
    def name(v):
        if isinstance(v, (list, tuple)):
            return [name(x) for x in v]
        return Path(v).name if isinstance(v, str) and v not in ("on", "off", "auto") else v

    return {k: (_portable(v) if isinstance(v, dict) else name(v) if k.endswith("_file") or k in PATH_KEYS else v)
            for k, v in settings.items()}


def _maybe_summary(values: list[float]) -> dict | None:
    return summarize(values) if values else None


def _paired(base: str, base_runs: list[dict], runs: list[dict]) -> dict:
    """A variant against its base arm, round by round (both ran in the same round, so a
    ratio of the two cancels what the machine did during that round)."""
    pairs = [(b, v) for b, v in zip(base_runs, runs) if not (b.get("out_of_memory") or v.get("out_of_memory"))]
    info = lambda run, key: (run.get("info") or {}).get(key)
    return {"arm": base,
            "decode_tps_ratio": summarize([v["decode_tps"] / b["decode_tps"] for b, v in pairs]),
            "peak_active_memory_delta": _maybe_summary([v["peak_active_memory"] - b["peak_active_memory"]
                                                        for b, v in pairs if v["peak_active_memory"] is not None]),
            # None where the base arm reads no experts (a resident arm): no ratio to give
            "expert_bytes_per_token_ratio": _maybe_summary([v["expert_bytes_per_token"] / b["expert_bytes_per_token"]
                                                            for b, v in pairs if b["expert_bytes_per_token"]]),
            "adapter_bytes": info(pairs[0][1], "adapter_bytes") if pairs else None,
            "experts_per_token": info(pairs[0][1], "experts_per_token") if pairs else None,
            "base_experts_per_token": info(pairs[0][0], "experts_per_token") if pairs else None}


def _document(model_dir, files, settings, replay, runs, orders) -> dict:
    for results in runs.values():
        for res in results:
            res["settings"] = _portable(res.get("settings", {}))
    arms = {}
    for name, all_results in runs.items():
        results = [res for res in all_results if not res.get("out_of_memory")]
        ooms = [res["memory_cap"] for res in all_results if res.get("out_of_memory")]
        arm: dict = {"runs": all_results}
        if ooms:
            peak = max(c["peak_bytes"] or 0 for c in ooms)
            arm["out_of_memory_runs"] = len(ooms)
            arm["did_not_run"] = f"out of memory at {peak / 2**20:.0f} MiB" if not results else None
        if results:
            for fig in FIGURES:  # (a figure an arm has no counterpart for is None: llama.cpp's MLX memory)
                values = [res[fig] for res in results if res.get(fig) is not None]
                if values:
                    arm[fig] = summarize(values)
            arm["consumed_digest"] = sorted({res["consumed_digest"] for res in results})
            arm["argmax_digest"] = sorted({res["argmax_digest"] for res in results})
            caps = [res["memory_cap"]["peak_bytes"] for res in results if res.get("memory_cap")]
            if caps and all(c is not None for c in caps):
                arm["cgroup_peak_bytes"] = summarize(caps)
        arms[name] = arm
    if BASELINE in arms and "decode_tps" in arms[BASELINE]:
        base = arms[BASELINE]
        for name, a in arms.items():
            if "decode_tps" in a:
                a["ratio_to_resident"] = {
                    fig: (a[fig]["median"] / base[fig]["median"]) if fig in a and base[fig]["median"] else None
                    for fig in ("decode_tps", "prefill_tps", "peak_active_memory", "peak_rss")
                }
    for name, a in arms.items():
        base = base_arm(name)
        if base != name and "decode_tps" in a and "decode_tps" in arms.get(base, {}):
            a["vs_base_arm"] = _paired(base, runs[base], runs[name])
    overlap = None
    if {"staged+oracle", "compute-only", "read-only"} <= {n for n, a in arms.items() if "decode_tps" in a}:
        staged = arms["staged+oracle"]["step_ms_median"]["median"]
        floor = max(arms["compute-only"]["step_ms_median"]["median"], arms["read-only"]["step_ms_median"]["median"])
        overlap = {"staged_step_ms": staged, "compute_only_step_ms": arms["compute-only"]["step_ms_median"]["median"],
                   "read_only_step_ms": arms["read-only"]["step_ms_median"]["median"],
                   "staged_over_max": staged / floor}
        if "step_ms_median" in arms.get("exact", {}):
            overlap["exact_step_ms"] = arms["exact"]["step_ms_median"]["median"]
    return {
        "schema": SCHEMA_VERSION, "overlap": overlap, "model": Path(model_dir).name, "checkpoint_bytes": sum(f.stat().st_size for f in files),
        "settings": _portable({k: (list(v) if isinstance(v, tuple) else v) for k, v in settings.__dict__.items()}),
        "replay": replay, "orders": orders, "arms": arms, "machine": machine.describe(model_dir),
    }
