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
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

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


def arm(name: str):
    def register(factory: ArmFactory) -> ArmFactory:
        ARMS[name] = factory
        return factory
    return register


@arm("resident")
def resident(model_dir: str, settings: dict) -> Loaded:
    """mlx-lm's resident model: every weight loaded. Non-expert floats are cast to the
    compute dtype; expert scales stay as stored, exactly what the streaming arms compute."""
    from edge0.backend import core as B
    from edge0.backend import nn as bnn

    model = bnn.load_full_model(model_dir)
    bnn.cast_model(model, B.dtype(settings["compute_dtype"]), skip=lambda k: ".switch_mlp." in k)
    return Loaded(model)


@arm("exact")
def exact(model_dir: str, settings: dict) -> Loaded:
    """Edge0's exact streaming path: experts read on demand every step."""
    from edge0.config import EngineConfig
    from edge0.engine import load_streaming_model

    cfg = EngineConfig(compute_dtype=settings["compute_dtype"],
                       bundle_capacity=settings.get("bundle_capacity", EngineConfig.bundle_capacity),
                       reader_threads=settings.get("reader_threads", EngineConfig.reader_threads))
    model, _, _, reader, executor = load_streaming_model(model_dir, cfg)
    return Loaded(model, lambda: reader.stats.bytes, lambda: reader.stats.seconds, reader.close,
                  info={"bundle_capacity": cfg.bundle_capacity})


def tokens_digest(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def replay(name: str, model_dir: str, prompt: list[int], continuation: list[int], settings: dict) -> dict:
    """Run arm ``name`` over the replay sequence; returns its figures (one JSON object)."""
    from edge0.backend import core as B
    from edge0.backend import nn as bnn
    from edge0.stats import peak_rss_bytes

    B.reset_peak_memory()
    t0 = time.perf_counter()
    loaded = ARMS[name](model_dir, settings)
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
        steps, step_bytes, step_waits = [], [], []
        for token in continuation:
            b, w = loaded.read_bytes(), loaded.read_seconds()
            t0 = time.perf_counter()
            logits = model(B.array([[token]]), cache=cache)
            B.eval(logits)
            steps.append(time.perf_counter() - t0)
            step_bytes.append(loaded.read_bytes() - b)
            step_waits.append(loaded.read_seconds() - w)
            argmax.append(int(logits[0, -1].argmax().item()))
        decode_seconds = sum(steps)
        return dict(
            arm=name, settings=settings, info=loaded.info, load_seconds=load_seconds,
            prompt_tokens=len(prompt), decode_tokens=len(continuation),
            consumed_digest=tokens_digest(prompt + continuation), argmax_digest=tokens_digest(argmax),
            prefill_tps=len(prompt) / prefill_seconds, decode_tps=len(continuation) / decode_seconds,
            step_ms=[s * 1e3 for s in steps],
            read_wait_ms_per_step=1e3 * sum(step_waits) / len(steps),
            expert_bytes_per_token=sum(step_bytes) / len(steps), prefill_expert_bytes=prefill_bytes,
            peak_active_memory=B.peak_memory(), peak_rss=peak_rss_bytes(),
            total_wait_ms=1e3 * (loaded.read_seconds() - wait0),
        )
    finally:
        loaded.close()


def main() -> int:
    """Child-process entry: ``python -m edge0.benchmark.arms JOB.json`` prints one JSON line."""
    job = json.loads(open(sys.argv[1], encoding="utf-8").read())
    result = replay(job["arm"], job["model"], job["prompt"], job["continuation"], job["settings"])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
