"""The whole recovery recipe, in the order the paper insists on: heads, then SFT, then
on-policy distillation, then the report (``edge0 train recipe``).

1. Phase 1: prerouter heads, trained on the model's training split (``edge0.train.heads``);
   held-out recall@k before and after.
2. Phase 2: the LoRA by SFT on the float32 teacher's continuations, on the student path
   (``edge0.train.sft``).
3. Phase 3: the same LoRA by on-policy reverse KL against the teacher
   (``edge0.train.distill``), about a tenth of phase 2's tokens.
4. Report: the adapter's effect on the served logits, the merge report, and (unless
   ``eval_tokens`` is 0) the quality table through the served path.

Heads go beside the checkpoint (``prerouter.safetensors``) and the final adapter to
``<model>/adapter`` unless ``out`` says otherwise: where the engine finds them.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from edge0.adapters import ADAPTER_DIRNAME
from edge0.config import EngineConfig
from edge0.prerouter.files import HEADS_FILENAME, heads_identities, heads_identity
from edge0.train import data as D
from edge0.train.distill import DistillConfig, run_distill
from edge0.train.heads import train_heads
from edge0.train.sft import SFTConfig, run_sft


@dataclass
class HeadsConfig:
    tokens: int = 600_000
    heldout_tokens: int = 20_000
    seq_len: int = 256
    steps: int = 3000
    batch: int = 512
    lr: float = 1e-3
    width: int = 512
    token_input: bool = True  # heads see the embedding of the token being decoded
    routing: str = "replace"  # the routing the heads file records (phases 2-3 train on it)
    stage_extra: int = 0  # select routing: experts staged beyond k


@dataclass
class RecipeConfig:
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    eval_tokens: int = 4096  # quality table over this many held-out tokens (0: none)
    experts_per_token: int | None = None


HEADS_RECORD = "heads_report.json"  # in the work directory: phase 1's figures and the heads' identity

QUICK = RecipeConfig(
    heads=HeadsConfig(tokens=3000, heldout_tokens=800, seq_len=64, steps=60, batch=128, width=32),
    sft=SFTConfig(rows=48, prompt_len=8, new_tokens=24, steps=24, batch=8, rank=4, lr=3e-3, warmup=3,
                  checkpoint_every=0),
    distill=DistillConfig(rows=6, prompt_len=8, new_tokens=16, steps=12, batch=4, lr=2e-3, warmup=2, top_k=8,
                          checkpoint_every=0),
    eval_tokens=48,
)


def run_recipe(model_dir: str | Path, teacher_dir: str | Path, cfg: RecipeConfig, *, work: str | Path,
               out: str | Path | None = None, resume: bool = False, progress=None, say=print) -> dict:
    model_dir, teacher_dir, work = Path(model_dir), Path(teacher_dir), Path(work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(out) if out is not None else model_dir
    out.mkdir(parents=True, exist_ok=True)
    k = cfg.experts_per_token
    for part in (cfg.sft, cfg.distill):
        part.experts_per_token = k
    heads_file = out / HEADS_FILENAME
    adapter_dir = out / ADAPTER_DIRNAME
    report: dict = {"model": str(model_dir), "teacher": str(teacher_dir), "config": asdict(cfg), "phases": {}}
    t0 = time.perf_counter()

    train, held, desc = D.token_streams(model_dir)
    heads_record = work / HEADS_RECORD
    done = json.loads(heads_record.read_text()) if resume and heads_record.exists() else None
    if done is not None and heads_file.exists() and done.get("identity") in heads_identities(heads_file):
        say(f"phase 1: prerouter heads (--resume: {heads_file} from the earlier run)")
        report["phases"]["heads"] = done
    else:
        say("phase 1: prerouter heads")
        h = cfg.heads
        heads = train_heads(model_dir, tokens=h.tokens, heldout_tokens=h.heldout_tokens, seq_len=h.seq_len,
                            steps=h.steps, batch=h.batch, lr=h.lr, width=h.width, out=heads_file,
                            streams=(train, held, desc), experts_per_token=k, token_input=h.token_input,
                            serving={"routing": h.routing, "stage_extra": h.stage_extra},
                            progress=progress("heads") if progress else None,
                            trace_say=say if progress else None)
        mean = lambda d: float(np.mean([v["recall_at_k"] for v in d.values()]))
        report["phases"]["heads"] = {"path": str(heads_file), "recall_before": mean(heads["before"]),
                                     "recall_after": mean(heads["after"]), "per_head": {
                                         str(o): {"before": heads["before"][o], "after": heads["after"][o]}
                                         for o in heads["before"]}, "losses": _ends(heads["losses"]),
                                     "tokens": heads["recipe"]["tokens"], "identity": heads_identity(heads_file)}
        heads_record.write_text(json.dumps(report["phases"]["heads"], indent=1))  # what --resume reuses

    say("phase 2: SFT on the student path")
    sft_dir = work / "adapter-sft"
    sft = run_sft(model_dir, teacher_dir, sft_dir, cfg.sft, work=work, heads_file=heads_file, resume=resume,
                  progress=progress("sft") if progress else None, say=say)
    report["phases"]["sft"] = _phase(sft)

    say("phase 3: on-policy distillation")
    dist = run_distill(model_dir, teacher_dir, sft_dir, adapter_dir, cfg.distill, work=work, heads_file=heads_file,
                       resume=resume, progress=progress("distill") if progress else None, say=say)
    report["phases"]["distill"] = _phase(dist)

    say("report")
    report["adapter_effect"] = adapter_effect(model_dir, heads_file, adapter_dir, k)
    from edge0.train.merge import merge_report

    report["merge"] = merge_report(model_dir, adapter_dir)
    if cfg.eval_tokens:
        report["quality"] = quality(model_dir, teacher_dir, heads_file, sft_dir, adapter_dir, held, cfg, work, say)
    report["wall_seconds"] = round(time.perf_counter() - t0, 1)
    (work / "recipe_report.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def _ends(losses: list[float], n: int = 10) -> dict:
    k = max(1, min(n, len(losses) // 2))
    return {"first": float(np.mean(losses[:k])), "last": float(np.mean(losses[-k:])), "steps": len(losses)}


def _phase(result: dict) -> dict:
    """``loss_before``/``loss_after``: the training loss on one fixed batch before the first
    step and after the last (batch-to-batch noise does not blur it)."""
    return {"adapter": result["adapter"], "losses": _ends(result["losses"]), "tokens": result["tokens"],
            "loss_before": result["loss_before"], "loss_after": result["loss_after"],
            "seconds": round(result["seconds"], 1), "stopped_by_budget": result["stopped_by_budget"],
            "data": result["data"]}


def adapter_effect(model_dir: Path, heads_file: Path, adapter_dir: Path, k: int | None) -> dict:
    """How far the adapter moves the served first-token logits (relative L2)."""
    from edge0.backend import core as B
    from edge0.loader import load_streaming_model

    ids = list(range(3, 19))
    out = {}
    for label, adapter in (("base", "off"), ("adapter", str(adapter_dir))):
        s = load_streaming_model(model_dir, EngineConfig(adapter=adapter, prerouter_file=str(heads_file),
                                                         experts_per_token=k))
        try:
            out[label] = B.to_host(s.model(B.array([ids]))[0, -1].astype(B.float32)).astype(np.float64)
        finally:
            s.close()
    return {"relative_l2": float(np.linalg.norm(out["adapter"] - out["base"]) / np.linalg.norm(out["base"]))}


def restamp_heads(heads_file: Path, model_dir: Path, merged: Path) -> Path:
    """The same heads, stamped for the merged checkpoint (its files differ from the base's)."""
    from edge0.prerouter.files import checkpoint_identity, load_heads, save_heads

    heads, meta = load_heads(heads_file, model_dir)
    recipe = json.loads(meta.get("recipe", "{}"))
    recipe["restamped_for"] = "the phase-3 adapter merged into the base and re-quantized"
    return save_heads(heads, merged / HEADS_FILENAME, base_identity=checkpoint_identity(merged), recipe=recipe,
                      training_data=meta.get("training_data", ""))


def quality(model_dir, teacher_dir, heads_file, sft_dir, adapter_dir, held, cfg: RecipeConfig, work: Path,
            say=print) -> dict:
    from edge0.train.merge import write_merged
    from edge0.train.quality import Row, quality_table, served_rows

    k = cfg.experts_per_token
    merged = write_merged(model_dir, adapter_dir, work / "merged")
    restamp_heads(heads_file, model_dir, merged)
    restamped = merged / HEADS_FILENAME  # the merged checkpoint is another base: its heads are stamped for it
    rows = served_rows(model_dir, heads_file, [("+ phase-2 adapter (SFT)", sft_dir),
                                               ("+ phase-3 adapter (on-policy)", adapter_dir)], k)
    rows.append(Row("phase-3 adapter merged, re-quantized", merged,
                    EngineConfig(prerouter="on", prerouter_file=str(restamped), adapter="off", experts_per_token=k)))
    tokens = D.ordinary_code(held, cfg.eval_tokens)
    return quality_table(teacher_dir, rows, tokens, say=say)
