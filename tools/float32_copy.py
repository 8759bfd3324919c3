"""A copy of an mlx-lm checkpoint whose floating tensors (quantization scales and biases,
norms, embeddings' scales) are float32: the anchor for a comparison with mlx-lm's own
tools at the activation dtype Edge0 computes in on MLX's CPU backend (float32; mlx-lm
computes in the dtype of the stored scales, and its quantized matmul with bfloat16
activations is several times slower there).

    python tools/float32_copy.py SRC_DIR OUT_DIR
    mlx_lm server --model OUT_DIR ...

Quantized weights (uint32) are copied as they are; the JSON and tokenizer files are copied;
Edge0's own artifacts beside the checkpoint (prerouter heads, adapters) are not.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import mlx.core as mx


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    src, out = Path(argv[0]), Path(argv[1])
    if out.exists() and any(out.iterdir()):
        print(f"{out} exists and is not empty", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".json" or f.name.startswith("tokenizer"):
            shutil.copy2(f, out / f.name)
    for f in sorted(src.glob("model*.safetensors")):
        tensors = mx.load(str(f))
        cast = {k: v.astype(mx.float32) if v.dtype in (mx.bfloat16, mx.float16) else v for k, v in tensors.items()}
        mx.save_safetensors(str(out / f.name), cast, metadata={"format": "mlx"})
        del tensors, cast
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
