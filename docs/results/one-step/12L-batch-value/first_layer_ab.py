"""The staged step with the first MoE layer on the exact path (default) against the same
layer held whole in a hot set (resident0), timed as the benchmark replays it: 32 prompt
tokens, then 40 decode steps of one token each through ``StepModel``, each evaluated; the
median step after 8. The two configurations alternate, one engine load each, ROUNDS times.

    python docs/results/one-step/12L-batch-value/first_layer_ab.py MODEL HEADS [ROUNDS]
"""

import statistics
import sys
import time

from edge0 import EngineConfig
from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.loader import load_streaming_model
from edge0.streaming import StepModel


def median_step_ms(model_dir: str, config: EngineConfig) -> float:
    s = load_streaming_model(model_dir, config)
    try:
        model = StepModel(s)
        cache = bnn.make_cache(model)
        B.eval(model(B.array([list(range(100, 132))]), cache=cache))
        steps = []
        for t in range(40):
            t0 = time.perf_counter()
            B.eval(model(B.array([[200 + t]]), cache=cache))
            steps.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(steps[8:])
    finally:
        s.close()


def main() -> None:
    model_dir, heads = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
    base = dict(prerouter="on", prerouter_file=heads, adapter="off", compute_dtype="float32")
    for _ in range(rounds):
        a = median_step_ms(model_dir, EngineConfig(**base))
        b = median_step_ms(model_dir, EngineConfig(**base, layer_paths=((0, "decode", "hot"),), hot_experts=256))
        print(f"default {a:.1f} ms, resident0 {b:.1f} ms, ratio {b / a:.3f}", flush=True)


if __name__ == "__main__":
    main()
