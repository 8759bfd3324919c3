"""What a teacher run leaves behind: the float32 teacher (:func:`save_teacher`), the int4
deployment checkpoint (:func:`quantize_checkpoint`: mlx-lm ``quantize_model`` with the
model's ``quant_predicate``, routers stay 8-bit), both in mlx-lm layout with
``provenance.json``, and the data files beside them (:func:`save_data`: the held-out token
ids and the train-set unigram counts for ``tools/eval_model.py``, and the file lists)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import platform
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map_with_path

from edge0.tiny import write_tokenizer
from edge0.train.corpus import Corpus
from edge0.train.teacher_config import FAMILY, TeacherConfig
from edge0.train.teacher_run import TrainResult

GROUP_SIZE = 64
BITS = 4

HELDOUT_FILE = "heldout_tokens.npy"
UNIGRAM_FILE = "train_unigram_counts.npy"
FILES_FILE = "corpus_files.json"


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
