"""What routing replacement costs: held-out perplexity with the prerouter's routing
against the same int4 model routed by its own gates.

Both runs go token by token through the serving path (one-token decode steps behind the
step hook), so the prerouter's prediction is the routing of every staged layer exactly as
at generation time; only the routing source differs between the two runs.
"""

from __future__ import annotations

import math
from pathlib import Path

from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.config import EngineConfig


def served_perplexity(model_dir: str | Path, tokens: list[int], config: EngineConfig, window: int = 256) -> dict:
    """Perplexity of ``tokens`` decoded one token per step, in windows of ``window`` tokens
    (the KV cache restarts per window; the first token of a window is not scored)."""
    from edge0.loader import StepModel, load_streaming_model

    s = load_streaming_model(Path(model_dir), config)
    nll, n = 0.0, 0
    try:
        for start in range(0, len(tokens) - 1, window):
            chunk = tokens[start:start + window]
            if len(chunk) < 2:
                break
            if s.stager is not None:
                s.stager.reset()
            model = StepModel(s)
            cache = bnn.make_cache(model)
            for t, nxt in zip(chunk[:-1], chunk[1:]):
                logits = model(B.array([[t]]), cache=cache)[0, -1].astype(B.float32)
                logp = B.log_softmax(logits)
                nll -= float(B.to_host(logp[nxt]))
                n += 1
    finally:
        s.close()
    return {"tokens": n, "nll": nll / n, "perplexity": math.exp(nll / n),
            "staged_layers": list(s.stager.layers) if s.stager is not None else []}


def routing_replacement_report(model_dir: str | Path, tokens: list[int], window: int = 256,
                               heads_file: str | None = None) -> dict:
    own = served_perplexity(model_dir, tokens, EngineConfig(prerouter="off"), window)
    pre = served_perplexity(model_dir, tokens, EngineConfig(prerouter="on", prerouter_file=heads_file), window)
    return {"own_gates": own, "prerouter": pre, "ratio": pre["perplexity"] / own["perplexity"]}
