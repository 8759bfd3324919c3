"""Run under ``mlx.launch`` (or alone, for the reference): greedy generations of one model
in several configurations, one JSON line per rank on standard output (or, with
``EDGE0_TEST_RESULTS`` set to a directory, one file per rank there).

argv[1]: a JSON object {"model": DIR, "prompt": [ids], "max_tokens": N,
"configs": {name: EngineConfig keywords, "temp" the sampling temperature (default 0)}, "die": rank that exits after loading (optional),
"together": [[ids], ...] (optional: generations asked for at once, as async tasks started in
this order, so that they decode in one batch; their tokens in "together"), "fewer_on": a rank
that asks for the last of them not (optional; its error is printed and the process exits 4)}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> None:
    from mlx.utils import tree_flatten

    from edge0 import Engine, EngineConfig
    from edge0.backend import core as B
    from edge0.backend import dist

    job = json.loads(sys.argv[1])
    g = dist.group()
    rank = g.rank() if g is not None else 0
    out = {"rank": rank, "size": g.size() if g is not None else 1, "results": {}}
    for name, kw in job["configs"].items():
        if g is None:  # the one-process reference of a named layout
            kw = {k: v for k, v in kw.items() if k != "pipeline_layers"}
        kw = dict(kw)
        temp = kw.pop("temp", 0.0)  # sampled with no seed: the ranks must agree on one
        B.reset_peak_memory()
        with Engine(job["model"], EngineConfig(**kw)) as engine:
            params = dict(tree_flatten(engine.model.parameters()))
            if job.get("die") == rank:
                os._exit(3)
            events = list(engine.stream(job["prompt"], max_tokens=job["max_tokens"], temp=temp))
            prompts = job.get("together", [])
            if job.get("fewer_on") == rank:
                prompts = prompts[:-1]
            try:
                together = _together(engine, prompts, job["max_tokens"], temp)
            except BaseException as e:  # noqa: BLE001 - said, then out (a stuck link must not hold the exit)
                print(f"ERROR {e!r}", file=sys.stderr, flush=True)
                os._exit(4)
            out["results"][name] = {
                "tokens": [e.token for e in events],
                "line": events[-1].stats.line(),
                "rank_bytes": events[-1].stats.rank_expert_bytes,
                "decode_bytes": events[-1].stats.decode_expert_bytes,
                "layers_read": sorted(engine.reader.stats.layer_bytes),
                "param_keys": sorted(params),
                "param_bytes": sum(v.nbytes for v in params.values()),
                "peak_memory": B.peak_memory(),
                "together": together,
                "steps": [engine.metrics().decode_steps, engine.metrics().decode_tokens],
                "micro_turns": engine.metrics().micro_turns,
                "prompt_cache": [len(engine.prompt_cache), engine.prompt_cache.nbytes] if engine.prompt_cache else None,
            }
    where = os.environ.get("EDGE0_TEST_RESULTS")
    if where:  # a file per rank: two ranks' long lines on one pipe can interleave
        Path(where, f"rank{rank}.json").write_text(json.dumps(out))
    else:
        print("RESULT " + json.dumps(out), flush=True)


def _together(engine, prompts: list, max_tokens: int, temp: float) -> list:
    """Each prompt's tokens, generated at once (async tasks started in the prompts' order)."""
    import anyio

    out = [None] * len(prompts)

    async def one(i: int) -> None:
        out[i] = [e.token async for e in engine.generate(prompts[i], max_tokens=max_tokens, temp=temp)
                  if e is not None]

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
                await anyio.sleep(0)  # each task asks for its generation before the next starts

    if prompts:
        anyio.run(run)
    return out


if __name__ == "__main__":
    main()
