"""What the training commands print on the terminal: messages (:func:`say`), progress bars
(:class:`Progress`) and the slow-BLAS warning (:func:`warn_if_slow_blas`).  Imports no array
library at module level, so the command line starts before MLX loads."""

from __future__ import annotations

import sys

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-serial/libopenblas.so.0"


def say(msg: str) -> None:
    print(f"[edge0 train] {msg}", file=sys.stderr, flush=True)


def warn_if_slow_blas(say) -> float:
    from edge0.train.teacher import matmul_gflops

    gflops = matmul_gflops()
    say(f"MLX float32 matmul: {gflops:.1f} GFLOP/s")
    if gflops < 20:
        say("WARNING: slow float32 matmul (MLX's bundled reference BLAS): training runs ~10x slower. "
            f"Fix: apt-get install libopenblas0-serial and run with LD_PRELOAD={OPENBLAS}")
    return gflops


class Progress:
    """A tqdm bar created on first use, showing the loss when there is one. The bar starts
    with the first report already counted, so its rate is measured between reports (a bar
    made and stepped at once showed thousands of steps a second)."""

    def __init__(self, desc: str, unit: str = "step"):
        self.desc, self.unit, self.bar = desc, unit, None

    def __call__(self, step: int, total: int, loss: float | None = None) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=step, desc=self.desc, unit=self.unit, file=sys.stderr)
        else:
            self.bar.update(step - self.bar.n)
        if loss is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
