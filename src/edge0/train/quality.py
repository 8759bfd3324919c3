"""Quality measured through the served path: what routing replacement, int4 and the
recovery adapter each cost or pay back, against the float32 teacher.

Every int4 row is decoded token by token through the engine's own step (one-token forwards
behind the step hook, in windows whose KV cache restarts), so the prerouter's prediction is
the routing of every staged layer exactly as at generation time and the adapter is applied
as served. The teacher runs its resident float32 model over the same windows. Per row:
perplexity, ratio to the teacher's, top-1 agreement with the teacher and mean
KL(teacher || row) per token, all over the same positions (the first token of each window
is context only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.config import EngineConfig


def _windows(tokens: list[int], window: int):
    for start in range(0, len(tokens) - 1, window):
        chunk = tokens[start:start + window]
        if len(chunk) >= 2:
            yield chunk


def served_logprobs(model_dir: str | Path, tokens: list[int], config: EngineConfig, window: int = 256) -> dict:
    """Log-probabilities [n, V] of every position after a window's first token, decoded one
    token per step through the served path, and the targets they predict."""
    from edge0.loader import load_streaming_model
    from edge0.streaming import StepModel

    s = load_streaming_model(Path(model_dir), config)
    rows, targets = [], []
    bytes0 = s.reader.stats.bytes
    try:
        for chunk in _windows(tokens, window):
            if s.stager is not None:
                s.stager.reset()
            model = StepModel(s)
            cache = bnn.make_cache(model)
            for t, nxt in zip(chunk[:-1], chunk[1:]):
                logits = model(B.array([[t]]), cache=cache)[0, -1].astype(B.float32)
                rows.append(B.to_host(B.log_softmax(logits)))
                targets.append(nxt)
    finally:
        s.close()
    return {"logp": np.stack(rows), "targets": np.array(targets),
            "staged_layers": list(s.stager.layers) if s.stager is not None else [],
            "expert_bytes_per_token": (s.reader.stats.bytes - bytes0) / max(1, len(targets)),
            "routing": s.routing}


def teacher_logprobs(teacher_dir: str | Path, tokens: list[int], window: int = 256) -> dict:
    """The same positions as ``served_logprobs``, from the resident float32 teacher."""
    model = bnn.load_teacher(Path(teacher_dir))
    rows, targets = [], []
    for chunk in _windows(tokens, window):
        logits = model(B.array([chunk[:-1]]))[0].astype(B.float32)
        rows.append(B.to_host(B.log_softmax(logits)))
        targets.extend(chunk[1:])
    return {"logp": np.concatenate(rows), "targets": np.array(targets)}


def served_perplexity(model_dir: str | Path, tokens: list[int], config: EngineConfig, window: int = 256) -> dict:
    out = served_logprobs(model_dir, tokens, config, window)
    nll = -float(np.mean(out["logp"][np.arange(len(out["targets"])), out["targets"]]))
    return {"tokens": len(out["targets"]), "nll": nll, "perplexity": math.exp(nll),
            "staged_layers": out["staged_layers"]}


def routing_replacement_report(model_dir: str | Path, tokens: list[int], window: int = 256,
                               heads_file: str | None = None) -> dict:
    own = served_perplexity(model_dir, tokens, EngineConfig(prerouter="off", adapter="off"), window)
    pre = served_perplexity(model_dir, tokens, EngineConfig(prerouter="on", prerouter_file=heads_file,
                                                            adapter="off"), window)
    return {"own_gates": own, "prerouter": pre, "ratio": pre["perplexity"] / own["perplexity"]}


@dataclass
class Row:
    label: str
    model_dir: Path | None  # None: the teacher
    config: EngineConfig | None = None


def served_rows(model_dir: Path, heads_file: Path | None, adapters: list[tuple[str, str]],
                k: int | None = None) -> list[Row]:
    """The teacher, the int4 base on its own gates, the base routed by the heads'
    prediction, then that plus each ``(label, adapter_dir)``, all at routing width ``k``."""
    heads = None if heads_file is None else str(heads_file)
    on = lambda adapter: EngineConfig(prerouter="on", prerouter_file=heads, adapter=adapter, experts_per_token=k)
    return [Row("float32 teacher", None),
            Row(OWN_GATES, model_dir, EngineConfig(prerouter="off", adapter="off", experts_per_token=k)),
            Row("int4 + prerouter", model_dir, on("off")),
            *(Row(label, model_dir, on(str(adapter))) for label, adapter in adapters)]


def compare(logp: np.ndarray, targets: np.ndarray, teacher: dict) -> dict:
    n = len(targets)
    nll = -float(np.mean(logp[np.arange(n), targets]))
    q = teacher["logp"]
    top1 = float(np.mean(np.argmax(logp, -1) == np.argmax(q, -1)))
    kl = float(np.mean((np.exp(q) * (q - logp)).sum(-1)))
    return {"tokens": n, "nll": nll, "perplexity": math.exp(nll), "top1_agreement": top1, "kl_teacher_row": kl}


def greedy_sample(row: Row, teacher_dir: Path, prompt: str, max_tokens: int) -> str:
    if row.model_dir is None:
        from mlx_lm import generate

        model = bnn.load_full_model(teacher_dir)
        bnn.cast_model(model, B.float32)
        return generate(model, bnn.load_tokenizer(teacher_dir), prompt=prompt, max_tokens=max_tokens, verbose=False)
    from edge0 import Engine

    with Engine(row.model_dir, row.config) as engine:
        return engine.generate_text(prompt, max_tokens=max_tokens, temp=0.0)[0]


OWN_GATES = "int4, own gates"


def quality_table(teacher_dir: str | Path | None, rows: list[Row], tokens: list[int], *, window: int = 256,
                  prompt: str = "def read_lines(path):", sample_tokens: int = 48, say=print) -> dict:
    """Every row's figures over the same positions, against the teacher (top-1 agreement,
    KL) and as perplexity ratios to the teacher and to the int4 base on its own gates.
    Without a teacher (``teacher_dir`` None, no teacher row), the reference of agreement
    and KL is the first served row (the int4 base on its own gates, as ``served_rows``
    orders them)."""
    teacher_dir = Path(teacher_dir) if teacher_dir is not None else None
    reference = teacher_logprobs(teacher_dir, tokens, window) if teacher_dir is not None else None
    results = []
    for row in rows:
        say(f"quality: {row.label}")
        if row.model_dir is None:
            if reference is None:
                raise ValueError("a teacher row needs teacher_dir")
            figures = compare(reference["logp"], reference["targets"], reference)
        else:
            served = served_logprobs(row.model_dir, tokens, row.config, window)
            if reference is None:
                reference = served
            assert np.array_equal(served["targets"], reference["targets"])
            figures = compare(served["logp"], served["targets"], reference)
            figures["staged_layers"] = served["staged_layers"]
            figures["expert_bytes_per_token"] = served["expert_bytes_per_token"]
            figures["routing"] = served["routing"]
        figures["sample"] = greedy_sample(row, teacher_dir, prompt, sample_tokens)
        results.append({"label": row.label, **figures})
    own = next((r["perplexity"] for r in results if r["label"] == OWN_GATES), None)
    for r in results:
        if teacher_dir is not None:
            r["ratio_to_teacher"] = r["perplexity"] / results[0]["perplexity"]
        if own is not None:
            r["ratio_to_own_gates"] = r["perplexity"] / own
    return {"rows": results, "tokens": len(reference["targets"]), "window": window, "prompt": prompt,
            "reference": "float32 teacher" if teacher_dir is not None else results[0]["label"]}




def markdown(table: dict) -> str:
    ref = "teacher" if table.get("reference", "float32 teacher") == "float32 teacher" else "own gates"
    teacher = all("ratio_to_teacher" in r for r in table["rows"])
    own = all("ratio_to_own_gates" in r for r in table["rows"])
    lines = ["| row | perplexity |" + (" ratio to teacher |" if teacher else "") + (" ratio to own gates |" if own else "")
             + f" top-1 agreement with {ref} | KL({ref} \\|\\| row) | expert MiB / token |",
             "|---|---:|" + "---:|" * (teacher + own) + "---:|---:|---:|"]
    for r in table["rows"]:
        per_token = r.get("expert_bytes_per_token")
        lines.append(f"| {r['label']} | {r['perplexity']:.3f} |" + (f" {r['ratio_to_teacher']:.3f} |" if teacher else "")
                     + (f" {r['ratio_to_own_gates']:.3f} |" if own else "")
                     + f" {r['top1_agreement']:.3f} | {r['kl_teacher_row']:.4f} | "
                     + (f"{per_token / 2**20:.3f} |" if per_token is not None else "- |"))
    lines += ["", f"Greedy samples (48 tokens after `{table['prompt']!s}`):", ""]
    for r in table["rows"]:
        sample = r["sample"].replace("`", "'")
        lines += [f"- {r['label']}:", "", "```python", table["prompt"] + sample, "```", ""]
    return "\n".join(lines)
