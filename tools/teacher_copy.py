"""Keep a rebuilt float32 teacher as a bfloat16 copy the repository can carry.

    python tools/teacher_copy.py TEACHER_DIR OUT_DIR [--expect-sha256 HEX] [--demo src/edge0/data/demo_model]

TEACHER_DIR is ``OUT/teacher`` of ``edge0 train teacher`` (float32, mlx-lm layout). Checks
the sha256 of its ``model.safetensors`` against the one the demo checkpoint's
``provenance.json`` records (``teacher_weights_sha256``: the teacher the demo was quantized
from), writes every float tensor in bfloat16 to ``OUT_DIR/model.safetensors`` with the
config (``torch_dtype`` bfloat16), tokenizer and a provenance holding the teacher's own
provenance, both files' sha256 and whether the original matched. ``mlx_lm.load``, ``edge0
eval --teacher``, ``edge0 train quality --teacher`` and ``edge0 train recipe --teacher``
read the copy as they read the original (they compute in float32).
Exit status 0 when the copy is written (a sha256 mismatch is reported, and recorded, but
still written), 2 on a bad input.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("teacher")
    p.add_argument("out")
    p.add_argument("--demo", default=str(Path(__file__).resolve().parent.parent / "src" / "edge0" / "data" / "demo_model"))
    p.add_argument("--expect-sha256", default=None, help="default: the demo's teacher_weights_sha256")
    a = p.parse_args(argv)
    src, out = Path(a.teacher), Path(a.out)
    weights = src / "model.safetensors"
    if not weights.is_file() or not (src / "config.json").is_file():
        print(f"{src}: no model.safetensors / config.json (not a teacher directory)", file=sys.stderr)
        return 2
    expect = a.expect_sha256
    if expect is None:
        demo = json.loads((Path(a.demo) / "provenance.json").read_text(encoding="utf-8"))
        expect = demo["teacher_weights_sha256"]["model.safetensors"]
    original = sha256(weights)
    tensors = mx.load(str(weights))
    copy = {k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), copy, metadata={"format": "mlx"})
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    prov_file = src / "provenance.json"
    prov = json.loads(prov_file.read_text(encoding="utf-8")) if prov_file.is_file() else {}
    prov["kind"] = "the float32 teacher, every float tensor cast to bfloat16 (a copy kept in the repository)"
    prov["trained_dtype"] = prov.get("dtype", "float32")
    prov["dtype"] = "bfloat16 (edge0 loads a teacher in float32 whatever its file stores)"
    prov["float32_original"] = {"model.safetensors_sha256": original, "expected_sha256": expect,
                                "matches_the_demo_teacher": original == expect}
    prov["weights_sha256"] = {"model.safetensors": sha256(out / "model.safetensors")}
    prov["copied_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (out / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n", encoding="utf-8")
    print(f"teacher {weights}: sha256 {original} ({'matches' if original == expect else 'DIFFERS from'} "
          f"the demo's teacher {expect}); bfloat16 copy in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
