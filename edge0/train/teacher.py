"""Train a small real MoE language model (the "teacher") on Python standard-library source.

Random tiny checkpoints (``edge0.tiny``) prove the engine computes what mlx-lm computes;
they say nothing about quality.  This module trains a small qwen3_moe model from scratch
with mlx-lm's own model classes, so that quality can be measured (``edge0.train.evaluate``) and
the demo has a model whose output looks like Python.

Pipeline (every step deterministic for a given Python installation and seed):

1-3. Corpus, split by file, tokenizer: ``edge0.train.corpus``.
4. Model: ``qwen3_moe`` from :func:`edge0.tiny.tiny_config` (head_dim 32), float32.
5. Training: random windows of ``seq_len + 1`` train tokens (NumPy generator seeded with
   ``seed``), AdamW with linear warm-up and cosine decay, gradient clipping, plus a
   Switch-style load-balancing loss ``E * sum_i f_i * P_i`` computed from each MoE
   block's router (mlx-lm's block does not compute it; :func:`balance_loss_capture`
   swaps the blocks' class for the duration of training only).
6. Outputs: the float32 teacher and an int4 group-64 deployment checkpoint (mlx-lm
   ``quantize_model`` with the model's ``quant_predicate``: routers stay 8-bit), both in
   mlx-lm layout with ``provenance.json``; the held-out token ids and the train-set
   unigram counts as ``.npy`` files for ``tools/eval_model.py``.

Like ``edge0.tiny``, this is a checkpoint builder: it uses MLX and mlx-lm directly, not the
engine's backend facade.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

from edge0.tiny import tiny_config, write_tokenizer
from edge0.train.corpus import Corpus, build_corpus

FAMILY = "qwen3_moe"
GROUP_SIZE = 64
BITS = 4

HELDOUT_FILE = "heldout_tokens.npy"
UNIGRAM_FILE = "train_unigram_counts.npy"
FILES_FILE = "corpus_files.json"
LOG_FILE = "train_log.jsonl"
RESUME_DIR = "resume"  # periodic training state: ``--resume`` continues from it


def matmul_gflops(n: int = 512) -> float:
    """Measured float32 matmul speed of MLX on this machine (GFLOP/s): MLX's Linux CPU
    wheel bundles a reference BLAS; training wants an optimised one preloaded."""
    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a @ b)
    t0 = time.perf_counter()
    for _ in range(3):
        mx.eval(a @ b)
    return 3 * 2 * n**3 / (time.perf_counter() - t0) / 1e9


# --------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class TeacherConfig:
    """Everything that determines a training run (recorded in provenance.json)."""

    # model (qwen3_moe; attention head_dim 32, hidden // 32 heads, half as many KV heads)
    layers: int = 8
    experts: int = 32
    k: int = 4
    hidden: int = 256
    moe_intermediate: int = 128
    vocab_size: int = 2048
    # data
    seq_len: int = 256
    batch_size: int = 16
    heldout_fraction: float = 0.05
    # optimisation
    steps: int = 1000
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    beta2: float = 0.95
    grad_clip: float = 1.0
    balance_weight: float = 0.01
    seed: int = 0
    # budget: stop after this many seconds of training; with ``fit_schedule_to_budget``
    # the step count (and so the cosine schedule) is shrunk after ``calibration_steps``
    # when the measured speed says ``steps`` would not fit.
    time_budget_s: float | None = None
    fit_schedule_to_budget: bool = True
    calibration_steps: int = 10
    # periodic held-out evaluation (0 = only at the end)
    eval_every: int = 0
    eval_tokens: int = 16384
    final_eval_tokens: int = 65536
    log_every: int = 10
    # write the resumable training state every N steps (0 = never)
    checkpoint_every: int = 50
    compile: bool = True

    def validate(self) -> None:
        def positive(name):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")

        for name in ("layers", "experts", "k", "hidden", "moe_intermediate", "vocab_size",
                     "seq_len", "batch_size", "steps", "eval_tokens", "final_eval_tokens",
                     "calibration_steps", "log_every"):
            positive(name)
        if self.k > self.experts:
            raise ValueError(f"k={self.k} exceeds experts={self.experts}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction={self.heldout_fraction!r} must be in (0, 1)")
        if self.vocab_size > 65535:
            raise ValueError("vocab_size must fit in uint16 (token files are stored as uint16)")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("lr must be > 0 and min_lr_ratio in [0, 1]")
        if self.warmup_steps < 0 or self.eval_every < 0 or self.balance_weight < 0:
            raise ValueError("warmup_steps, eval_every and balance_weight must be >= 0")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"time_budget_s={self.time_budget_s!r} must be > 0")
        # tiny_config validates hidden / moe_intermediate / vocab_size further
        model_config(self)


def model_config(tc: TeacherConfig) -> dict:
    """The config.json dict (unquantized, float32) of the teacher described by ``tc``."""
    cfg = tiny_config(FAMILY, layers=tc.layers, experts=tc.experts, k=tc.k, hidden=tc.hidden,
                      moe_intermediate=tc.moe_intermediate, vocab_size=tc.vocab_size)
    cfg["torch_dtype"] = "float32"
    return cfg


# --------------------------------------------------------------------------
# load-balancing loss
# --------------------------------------------------------------------------

_AUX: list = []  # per-block balance losses of the forward pass being traced


def _balanced_block_class(base: type) -> type:
    """A subclass of mlx-lm's qwen3_moe block whose forward is op for op the block's,
    and which also appends the Switch load-balancing loss ``E * sum_i f_i * P_i`` to
    ``_AUX``: ``f_i`` is the share of the token->expert assignments that went to expert
    ``i`` (no gradient), ``P_i`` the mean router probability of expert ``i``.  Equal to 1
    when routing is uniform, up to E when collapsed."""

    class BalancedMoeBlock(base):
        def __call__(self, x):
            gates = mx.softmax(self.gate(x), axis=-1, precise=True)
            k = self.top_k
            inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
            scores = mx.take_along_axis(gates, inds, axis=-1)
            if self.norm_topk_prob:
                scores = scores / mx.sum(scores, axis=-1, keepdims=True)
            y = self.switch_mlp(x, inds)
            y = (y * scores[..., None]).sum(axis=-2).astype(y.dtype)

            n_exp = self.num_experts
            probs = gates.reshape(-1, n_exp)
            onehot = (inds.reshape(-1, k)[..., None] == mx.arange(n_exp)).astype(probs.dtype)
            f = mx.stop_gradient(onehot.sum(axis=(0, 1)) / (probs.shape[0] * k))
            _AUX.append(n_exp * mx.sum(f * probs.mean(axis=0)))
            return y

    BalancedMoeBlock.__name__ = f"Balanced{base.__name__}"
    return BalancedMoeBlock


@contextlib.contextmanager
def balance_loss_capture(model: nn.Module):
    """Within the block, every qwen3_moe MoE block of ``model`` appends its balance loss
    to the module-level list ``_AUX`` on each forward (same outputs, same parameter
    names).  The blocks' class is restored on exit."""
    from mlx_lm.models.qwen3_moe import Qwen3MoeSparseMoeBlock

    balanced = _balanced_block_class(Qwen3MoeSparseMoeBlock)
    blocks = [m for _, m in model.named_modules() if type(m) is Qwen3MoeSparseMoeBlock]
    if not blocks:
        raise ValueError("balance_loss_capture: the model has no qwen3_moe MoE block")
    for m in blocks:
        m.__class__ = balanced
    try:
        yield len(blocks)
    finally:
        for m in blocks:
            m.__class__ = Qwen3MoeSparseMoeBlock
        _AUX.clear()


# --------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------


def lr_at(tc: TeacherConfig, step: int, total_steps: int) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine to ``lr * min_lr_ratio``
    at ``total_steps`` (``step`` counts from 0)."""
    warm = min(tc.warmup_steps, max(total_steps - 1, 0))
    if step < warm:
        return tc.lr * (step + 1) / warm
    span = max(total_steps - warm, 1)
    progress = min((step - warm) / span, 1.0)
    floor = tc.lr * tc.min_lr_ratio
    return floor + 0.5 * (tc.lr - floor) * (1.0 + math.cos(math.pi * progress))


def _batch(tokens: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int):
    if tokens.size < seq_len + 2:
        raise ValueError(f"the train stream has {tokens.size} tokens, fewer than seq_len + 2 = {seq_len + 2}")
    starts = rng.integers(0, tokens.size - seq_len - 1, size=batch)
    win = np.stack([tokens[s:s + seq_len + 1] for s in starts]).astype(np.int32)
    return mx.array(win[:, :-1]), mx.array(win[:, 1:])


@dataclass
class TrainResult:
    model: nn.Module
    config: dict  # config.json of the float32 teacher
    steps_planned: int
    steps_done: int
    tokens_seen: int
    final_train_loss: float  # mean cross-entropy of the last ``log_every`` steps (nats/token)
    final_balance_loss: float
    heldout_loss: float  # nats/token on the first ``final_eval_tokens`` held-out tokens
    heldout_tokens_evaluated: int
    wall_time_s: float
    tokens_per_s: float
    stopped_by_budget: bool
    schedule_fitted_to_budget: bool
    log: list[dict] = field(default_factory=list)


def _heldout_loss(model: nn.Module, tokens: np.ndarray, seq_len: int, max_tokens: int) -> tuple[float, int]:
    from edge0.train.evaluate import evaluate_tokens

    res = evaluate_tokens(model, tokens, seq_len=seq_len, max_tokens=max_tokens, batch_size=8)
    return res.nll, res.n_tokens


def _save_state(resume: Path, model: nn.Module, optimizer, rng: np.random.Generator, meta: dict) -> None:
    """Write the training state (weights, optimizer moments, sampler state, counters) to
    ``resume``: into a temp directory first, then renamed, so a kill leaves the old state."""
    tmp = resume.with_name(resume.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())))
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    meta = dict(meta, rng=rng.bit_generator.state)
    (tmp / "state.json").write_text(json.dumps(meta), encoding="utf-8")
    for p in tmp.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    old = resume.with_name(resume.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if resume.exists():
        resume.rename(old)
    tmp.rename(resume)
    shutil.rmtree(old, ignore_errors=True)


def _load_state(resume: Path, tc: TeacherConfig, model: nn.Module, optimizer, rng: np.random.Generator) -> dict:
    """Restore what ``_save_state`` wrote; refuses a state written for another config."""
    meta = json.loads((resume / "state.json").read_text(encoding="utf-8"))
    mine = {k: v for k, v in asdict(tc).items() if k not in _RESUMABLE_CHANGES}
    theirs = {k: v for k, v in meta["train_config"].items() if k not in _RESUMABLE_CHANGES}
    if mine != theirs:
        diff = sorted(k for k in mine if mine.get(k) != theirs.get(k))
        raise ValueError(f"{resume} holds a run with other settings ({', '.join(diff)}); "
                         "start afresh with --overwrite or resume with the same settings")
    model.load_weights(str(resume / "model.safetensors"), strict=True)
    optimizer.state = tree_unflatten(list(mx.load(str(resume / "optimizer.safetensors")).items()))
    rng.bit_generator.state = meta["rng"]
    return meta


# Settings that may differ between a run and its resumption (they do not change the math).
_RESUMABLE_CHANGES = ("time_budget_s", "eval_every", "log_every", "checkpoint_every", "compile")


def train(tc: TeacherConfig, corpus: Corpus, *, progress: bool = True,
          log_path: Path | None = None, on_log: Callable[[dict], None] | None = None,
          resume_dir: Path | None = None, resume: bool = False) -> TrainResult:
    """Train a fresh float32 qwen3_moe on ``corpus.train_tokens``; returns the model
    (in mlx-lm's own classes, ready for ``save_model``) and the run's numbers.

    With ``resume_dir`` the training state is written there every ``checkpoint_every``
    steps; ``resume=True`` continues from it. A resumed run is bit-identical to an
    uninterrupted one (same weights, moments, sampler state and schedule)."""
    from mlx_lm.utils import _get_classes

    tc.validate()
    cfg = model_config(tc)
    mx.random.seed(tc.seed)
    rng = np.random.default_rng(tc.seed)
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    mx.eval(model.parameters())

    optimizer = optim.AdamW(learning_rate=lr_at(tc, 0, tc.steps), betas=(0.9, tc.beta2),
                            weight_decay=tc.weight_decay)
    train_tokens = corpus.train_tokens
    log: list[dict] = []
    total, fitted, step, elapsed_before = tc.steps, False, 0, 0.0
    ce_hist: list[float] = []
    bal_hist: list[float] = []
    if resume and resume_dir is not None and (resume_dir / "state.json").exists():
        state = _load_state(resume_dir, tc, model, optimizer, rng)
        total, fitted, step = state["total"], state["fitted"], state["step"]
        elapsed_before, ce_hist, bal_hist, log = state["elapsed_s"], state["ce"], state["bal"], state["log"]
    log_fh = open(log_path, "w", encoding="utf-8") if log_path else None
    if log_fh:
        for record in log:
            log_fh.write(json.dumps(record) + "\n")

    def emit(record: dict) -> None:
        log.append(record)
        if log_fh:
            log_fh.write(json.dumps(record) + "\n")
            log_fh.flush()
        if on_log:
            on_log(record)

    with balance_loss_capture(model):

        def loss_fn(model, x, y):
            _AUX.clear()
            logits = model(x)
            ce = nn.losses.cross_entropy(logits.astype(mx.float32), y, reduction="mean")
            bal = sum(_AUX) / len(_AUX)
            _AUX.clear()
            return ce + tc.balance_weight * bal, ce, bal

        loss_and_grad = nn.value_and_grad(model, loss_fn)

        def step_fn(x, y):
            (_, ce, bal), grads = loss_and_grad(model, x, y)
            grads, _ = optim.clip_grad_norm(grads, tc.grad_clip)
            optimizer.update(model, grads)
            return ce, bal

        if tc.compile:
            state = [model.state, optimizer.state]
            step_fn = mx.compile(step_fn, inputs=state, outputs=state)

        stopped = False
        tokens_per_step = tc.batch_size * tc.seq_len
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=total, initial=step, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
        t0 = time.perf_counter() - elapsed_before
        t_calib = None
        start_step = step
        try:
            while step < total:
                x, y = _batch(train_tokens, rng, tc.batch_size, tc.seq_len)
                optimizer.learning_rate = mx.array(lr_at(tc, step, total), dtype=mx.float32)
                ce, bal = step_fn(x, y)
                mx.eval(ce, bal, model.state, optimizer.state)
                ce_v, bal_v = ce.item(), bal.item()
                if not math.isfinite(ce_v):
                    raise FloatingPointError(f"training diverged: loss {ce_v} at step {step}")
                ce_hist.append(ce_v)
                bal_hist.append(bal_v)
                step += 1
                elapsed = time.perf_counter() - t0
                if step == start_step + 2:
                    t_calib = (time.perf_counter(), step)  # excludes compile / first-step cost
                if (tc.time_budget_s is not None and tc.fit_schedule_to_budget and not fitted
                        and t_calib is not None and step == t_calib[1] + tc.calibration_steps):
                    per_step = (time.perf_counter() - t_calib[0]) / tc.calibration_steps
                    # keep 5% of the budget as a margin against speed changes
                    affordable = int((0.95 * tc.time_budget_s - elapsed) / per_step) + step
                    if affordable < total:
                        total = max(affordable, step + 1)
                        fitted = True
                        if bar is not None:
                            bar.total = total
                            bar.refresh()
                if step % tc.log_every == 0 or step == total:
                    rec = {"step": step, "lr": lr_at(tc, step - 1, total),
                           "loss": float(np.mean(ce_hist[-tc.log_every:])),
                           "balance": float(np.mean(bal_hist[-tc.log_every:])),
                           "tokens": step * tokens_per_step, "elapsed_s": round(elapsed, 2)}
                    if tc.eval_every and step % tc.eval_every == 0 and step < total:
                        rec["heldout_loss"], _ = _heldout_loss(model, corpus.heldout_tokens, tc.seq_len,
                                                               tc.eval_tokens)
                    emit(rec)
                if resume_dir is not None and tc.checkpoint_every and step % tc.checkpoint_every == 0 \
                        and step < total:
                    _save_state(resume_dir, model, optimizer, rng,
                                dict(train_config=asdict(tc), step=step, total=total, fitted=fitted,
                                     elapsed_s=elapsed, ce=ce_hist, bal=bal_hist, log=log))
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{ce_v:.3f}", bal=f"{bal_v:.3f}",
                                    tok_s=f"{(step - start_step) * tokens_per_step / max(elapsed - elapsed_before, 1e-9):.0f}")
                if tc.time_budget_s is not None and elapsed >= tc.time_budget_s and step < total:
                    stopped = True
                    break
        finally:
            if bar is not None:
                bar.close()
        train_time = time.perf_counter() - t0

    model.eval()
    heldout, n_eval = _heldout_loss(model, corpus.heldout_tokens, tc.seq_len, tc.final_eval_tokens)
    wall = time.perf_counter() - t0
    tail = max(1, min(tc.log_every, len(ce_hist)))
    result = TrainResult(
        model=model, config=cfg, steps_planned=tc.steps, steps_done=step,
        tokens_seen=step * tokens_per_step,
        final_train_loss=float(np.mean(ce_hist[-tail:])),
        final_balance_loss=float(np.mean(bal_hist[-tail:])),
        heldout_loss=heldout, heldout_tokens_evaluated=n_eval, wall_time_s=wall,
        tokens_per_s=step * tokens_per_step / max(train_time, 1e-9),
        stopped_by_budget=stopped, schedule_fitted_to_budget=fitted, log=log,
    )
    emit({"final": True, "steps": step, "train_loss": result.final_train_loss,
          "heldout_loss": heldout, "wall_time_s": round(wall, 2)})
    if log_fh:
        log_fh.close()
    return result


# --------------------------------------------------------------------------
# saving
# --------------------------------------------------------------------------


def _versions() -> dict:
    import importlib.metadata as md

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    import edge0

    return {"edge0": edge0.__version__, "mlx": version("mlx"), "mlx_lm": version("mlx-lm"),
            "tokenizers": version("tokenizers"), "numpy": np.__version__,
            "python": platform.python_version()}


def _weights_sha256(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(directory).glob("model*.safetensors"))}


def dir_size(directory: Path) -> int:
    """Total bytes of the regular files directly in ``directory``."""
    return sum(p.stat().st_size for p in Path(directory).iterdir() if p.is_file())


def _clear_checkpoint(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for p in out.iterdir():
        if p.is_file() and (p.name.startswith("model") or p.name in (
                "config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "provenance.json")):
            p.unlink()


def save_teacher(result: TrainResult, corpus: Corpus, tc: TeacherConfig, out_dir: Path,
                 *, command: str | None = None) -> Path:
    """Write the float32 teacher (mlx-lm layout), its tokenizer and provenance.json."""
    from mlx_lm.utils import save_config, save_model

    out = Path(out_dir)
    _clear_checkpoint(out)
    save_model(out, result.model)
    save_config(dict(result.config), out / "config.json")
    write_tokenizer(corpus.tokenizer_json, out)
    prov = {
        "kind": "teacher (float32, trained from scratch)",
        "model_type": FAMILY,
        "dtype": "float32",
        "corpus": corpus.description(),
        "train_config": asdict(tc),
        "model_config": result.config,
        "seed": tc.seed,
        "steps_planned": result.steps_planned,
        "steps": result.steps_done,
        "tokens_seen": result.tokens_seen,
        "final_train_loss": result.final_train_loss,
        "final_train_loss_note": f"mean cross-entropy (nats/token) of the last {tc.log_every} steps",
        "final_balance_loss": result.final_balance_loss,
        "heldout_loss": result.heldout_loss,
        "heldout_perplexity": math.exp(result.heldout_loss),
        "heldout_tokens_evaluated": result.heldout_tokens_evaluated,
        "heldout_eval_seq_len": tc.seq_len,
        "wall_time_s": round(result.wall_time_s, 2),
        "train_tokens_per_s": round(result.tokens_per_s, 1),
        "stopped_by_budget": result.stopped_by_budget,
        "schedule_fitted_to_budget": result.schedule_fitted_to_budget,
        "versions": _versions(),
        "edge0_version": _versions()["edge0"],
        "platform": platform.platform(),
        "command": command,
        "weights_sha256": _weights_sha256(out),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (out / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n", encoding="utf-8")
    return out


def quantize_checkpoint(teacher_dir: Path, out_dir: Path, *, bits: int = BITS,
                        group_size: int = GROUP_SIZE, dtype: str = "bfloat16") -> Path:
    """The deployment checkpoint: load the teacher, cast floats to ``dtype`` (as
    ``mlx_lm.convert`` does) and quantize with mlx-lm's ``quantize_model`` and the model's
    ``quant_predicate`` (qwen3_moe routers are 8-bit), affine ``bits``-bit, ``group_size``.
    Copies the tokenizer and writes provenance.json (the teacher's, plus the conversion)."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    teacher_dir, out = Path(teacher_dir), Path(out_dir)
    if not (teacher_dir / "config.json").exists():
        raise FileNotFoundError(f"{teacher_dir} is not a checkpoint (no config.json)")
    dtypes = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
    if dtype not in dtypes:
        raise ValueError(f"dtype={dtype!r}; supported: {', '.join(dtypes)}")
    model, config = load_model(teacher_dir, lazy=False)
    keep = getattr(model, "cast_predicate", lambda _: True)
    target = dtypes[dtype]
    model.update(tree_map_with_path(
        lambda p, v: v.astype(target) if keep(p) and mx.issubdtype(v.dtype, mx.floating) else v,
        model.parameters()))
    config = dict(config)
    config["torch_dtype"] = dtype
    with contextlib.redirect_stdout(io.StringIO()):
        model, qconfig = quantize_model(model, config, group_size, bits, mode="affine")
    mx.eval(model.parameters())
    _clear_checkpoint(out)
    save_model(out, model)
    save_config(qconfig, out / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(teacher_dir / name, out / name)
    prov = json.loads((teacher_dir / "provenance.json").read_text(encoding="utf-8"))
    prov["kind"] = f"deployment checkpoint: int{bits} group-{group_size} affine of the teacher"
    prov["dtype"] = f"int{bits} experts/attention/embeddings, {dtype} norms and scales"
    prov["quantization"] = {
        "bits": bits, "group_size": group_size, "mode": "affine", "float_dtype": dtype,
        "tool": "mlx_lm.utils.quantize_model with the model's quant_predicate",
        "per_layer_overrides": {k: v for k, v in qconfig["quantization"].items() if isinstance(v, dict)},
    }
    prov["teacher_weights_sha256"] = prov.pop("weights_sha256")
    prov["weights_sha256"] = _weights_sha256(out)
    prov["size_bytes"] = dir_size(out)
    prov["converted_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (out / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n", encoding="utf-8")
    prov["size_bytes"] = dir_size(out)  # include provenance.json itself
    (out / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n", encoding="utf-8")
    return out


def save_data(corpus: Corpus, out_dir: Path) -> dict[str, Path]:
    """Held-out token ids, train unigram counts and the file lists, next to the teacher."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"heldout": out / HELDOUT_FILE, "unigram": out / UNIGRAM_FILE, "files": out / FILES_FILE}
    np.save(paths["heldout"], corpus.heldout_tokens)
    np.save(paths["unigram"], corpus.unigram_counts())
    paths["files"].write_text(json.dumps({
        "stdlib_root": corpus.root, "train": corpus.train_files, "heldout": corpus.heldout_files,
        "skipped_not_utf8": corpus.skipped_files}, indent=1) + "\n", encoding="utf-8")
    return paths


def train_teacher(tc: TeacherConfig, out_dir: Path, *, files: Sequence[str] | None = None,
                  root: Path | None = None, progress: bool = True, command: str | None = None,
                  say: Callable[[str], None] = lambda s: None, resume: bool = False) -> dict:
    """The whole pipeline into ``out_dir``: ``teacher/`` (float32), ``int4/`` (deployment),
    ``heldout_tokens.npy``, ``train_unigram_counts.npy``, ``corpus_files.json`` and
    ``train_log.jsonl``.  Returns a summary dict (paths and the run's numbers)."""
    tc.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    corpus = build_corpus(tc.heldout_fraction, tc.vocab_size, root=root, files=files)
    say(f"corpus: {len(corpus.train_files)} train files ({corpus.train_tokens.size:,} tokens), "
        f"{len(corpus.heldout_files)} held-out files ({corpus.heldout_tokens.size:,} tokens), "
        f"built in {time.perf_counter() - t0:.1f} s")
    data = save_data(corpus, out)
    result = train(tc, corpus, progress=progress, log_path=out / LOG_FILE, resume_dir=out / RESUME_DIR,
                   resume=resume)
    say(f"trained {result.steps_done} steps ({result.tokens_seen:,} tokens) in {result.wall_time_s:.0f} s: "
        f"train loss {result.final_train_loss:.4f}, held-out loss {result.heldout_loss:.4f} "
        f"(ppl {math.exp(result.heldout_loss):.2f}), {result.tokens_per_s:.0f} tok/s")
    teacher = save_teacher(result, corpus, tc, out / "teacher", command=command)
    shutil.rmtree(out / RESUME_DIR, ignore_errors=True)
    int4 = quantize_checkpoint(teacher, out / "int4")
    size = dir_size(int4)
    say(f"teacher: {teacher} ({dir_size(teacher) / 2**20:.1f} MiB); int4: {int4} ({size / 2**20:.2f} MiB)")
    return {"out": str(out), "teacher": str(teacher), "int4": str(int4), "int4_bytes": size,
            "heldout": str(data["heldout"]), "unigram": str(data["unigram"]),
            "steps": result.steps_done, "tokens_seen": result.tokens_seen,
            "final_train_loss": result.final_train_loss, "heldout_loss": result.heldout_loss,
            "wall_time_s": result.wall_time_s, "tokens_per_s": result.tokens_per_s,
            "stopped_by_budget": result.stopped_by_budget,
            "schedule_fitted_to_budget": result.schedule_fitted_to_budget}
