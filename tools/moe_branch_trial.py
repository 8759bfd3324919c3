"""Trial: a small trainable MLP beside each predicted layer's MoE block (a resident "expert"
the adapter owns), trained like the shipped adapter (forward KL to the teacher's top-K on
the training split, on the student path), to see what a delta on the experts' side buys
where an attention LoRA cannot turn a wrong expert's output into the right one's.

Measured on the student path (the served computation, teacher-forced over whole windows)
over the held-out positions ``edge0 train quality`` uses; every row of one run goes
through the same computation, so the rows compare with each other (the engine's own
decode is what QUALITY.md's main table measures). Nothing here is served.

    LD_PRELOAD=.../openblas-serial/libopenblas.so.0 python tools/moe_branch_trial.py \
        --teacher teachers/demo-v2 --work WORK --routing replace --width 64 --steps 300 --json OUT.json

(docs/results/moe-branch/run.sh runs both routings; serial OpenBLAS as docs/TEACHER.md says.)
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from edge0.backend import nn as bnn
from edge0.train import data as D
from edge0.train.distill import fit_topk, forward_kl_topk
from edge0.train.quality import _windows
from edge0.train.settings import SFTConfig
from edge0.train.sft import corpus_targets
from edge0.train.student import StudentModel


class BranchedBlock(nn.Module):
    """The MoE block's own output plus ``down(silu(gate x) * up x)`` of a small width
    (``down`` starts at zero, so the block starts as it was)."""

    def __init__(self, block, dim: int, width: int, seed: int):
        super().__init__()
        self.block = block
        key = mx.random.key(seed)
        k1, k2 = mx.random.split(key)
        s = 1.0 / math.sqrt(dim)
        self.gate = mx.random.normal((dim, width), key=k1) * s
        self.up = mx.random.normal((dim, width), key=k2) * s
        self.down = mx.zeros((width, dim))

    def __call__(self, x, *args, **kwargs):
        y = self.block(x, *args, **kwargs)
        h = nn.silu(x @ self.gate) * (x @ self.up)
        return y + (h @ self.down).astype(y.dtype)


def attach_branches(student: StudentModel, layers: list[int], width: int) -> list[str]:
    paths = []
    for layer in layers:
        path = student.spec.switch_path(layer).rsplit(".", 1)[0]
        block = bnn.module_at(student.model, path)
        dim = student.model.args.hidden_size
        bnn.set_module_at(student.model, path, BranchedBlock(block, dim, width, seed=layer))
        paths.append(path)
    return paths


def heldout_nll(student: StudentModel, tokens: list[int], window: int = 256) -> dict:
    """Mean next-token NLL over every window position after the first, the first token
    routing by its own gates and the rest by prediction (as decoded)."""
    nll, n = 0.0, 0
    for chunk in _windows(tokens, window):  # the windows `edge0 train quality` scores
        t = mx.array([chunk])
        logits = student.logits(t, np.array([1]))[0, :-1].astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tgt = mx.array(chunk[1:])
        nll += -float(mx.take_along_axis(logp, tgt[:, None], axis=-1).sum())
        n += len(chunk) - 1
    return {"positions": n, "nll": nll / n, "perplexity": math.exp(nll / n)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "src/edge0/data/demo_model"))
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--routing", default="replace", choices=["replace", "select"])
    ap.add_argument("--width", type=int, default=64, help="the branch's hidden width")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--rows", type=int, default=4096, help="training windows the teacher scores")
    ap.add_argument("--with-lora", action="store_true", help="train the attention LoRA beside the branch")
    ap.add_argument("--positions", type=int, default=4096, help="held-out tokens (ordinary code)")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    cfg = SFTConfig(text="corpus", routing=a.routing, steps=a.steps, lr=a.lr, rows=a.rows)
    t0 = time.perf_counter()
    rows, top_idx, top_lp, meta = corpus_targets(Path(a.teacher), Path(a.model), cfg, work)
    mask = D.continuation_mask(rows, cfg.prompt_len)
    _, held, _ = D.token_streams(a.model)
    tokens = D.ordinary_code(held, a.positions)
    student = StudentModel(a.model, rank=cfg.rank, scale=cfg.scale, seed=cfg.seed, routing=a.routing)
    consumers = sorted(student.ctx.heads.consumers())
    report = {"routing": a.routing, "width": a.width, "steps": a.steps, "lr": a.lr, "with_lora": a.with_lora,
              "consumers": consumers, "scored_s": round(time.perf_counter() - t0, 1)}
    report["none"] = heldout_nll(student, tokens)
    print("none", report["none"], flush=True)
    attach_branches(student, consumers, a.width)
    if not a.with_lora:
        for w in student.adapted.values():
            w.freeze()
    report["trainable"] = sum(v.size for _, v in tree_flatten(student.model.trainable_parameters()))
    t1 = time.perf_counter()
    fit = fit_topk(student, forward_kl_topk, rows, top_idx, top_lp, mask, cfg, name="branch",
                   phase="trial: an MLP beside each predicted MoE block", model_dir=Path(a.model),
                   teacher_dir=Path(a.teacher), data_meta=meta, work=work / f"branch-{a.routing}-{a.width}",
                   out=work / f"branch-{a.routing}-{a.width}-lora", resume=True, progress=None, dp=None)
    report["train_s"] = round(time.perf_counter() - t1, 1)
    report["loss_before"], report["loss_after"] = fit["loss_before"], fit["loss_after"]
    mx.save_safetensors(str(work / f"branch-{a.routing}-{a.width}.safetensors"),
                        dict(tree_flatten(student.model.trainable_parameters())))
    report["branch"] = heldout_nll(student, tokens)
    print("branch", report["branch"], flush=True)
    Path(a.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
