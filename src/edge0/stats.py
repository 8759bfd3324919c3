"""Generation statistics: speed per phase, memory peaks, expert bytes read."""

from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass


def peak_rss_bytes() -> int:
    """Peak resident set size of this process.

    On Linux, VmHWM of /proc/self/status: ru_maxrss survives exec, so a process started by
    a large parent would report the parent's peak. Elsewhere ru_maxrss (bytes on macOS).
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prompt cache (not prefilled)
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefill_expert_bytes: int = 0
    decode_expert_bytes: int = 0
    read_wait_seconds: float = 0.0
    stall_ms_per_step: float = 0.0  # staged layers: compute waiting on reads, per decode step
    guard_recall: dict | None = None  # quality guard: staged layer -> mean recall@k of the prediction
    peak_active_memory: int = 0  # bytes, MLX buffers
    peak_rss: int = 0  # bytes, whole process
    compute_dtype: str = ""  # the activation dtype the engine resolved
    kernels: str = ""  # which kernels computed the quantized matmuls: "mlx" or "edge0 (avx512, 2 threads)"
    heads: str | None = None  # the prerouter heads in use (they change the output), or None
    adapter: str | None = None  # the adapter applied, or None
    # how experts reached the kernels: "direct" (O_DIRECT reads), "buffered" (reads through the page
    # cache) or "mapped" (computed where the checkpoint's mapping holds them: nothing read, no copy)
    reads: str = "buffered"
    pipeline: str | None = None  # the pipeline's ranks and their layers, or None (one process)
    rank_expert_bytes: list | None = None  # a pipeline: each rank's decode expert bytes (the totals above sum them)
    expert_cache: str | None = None  # the expert cache ("lfu, 512 MiB"), or None (off)
    decode_cache_hits: int = 0  # experts the cache served at decode (memory copies, not reads)
    decode_cache_bytes: int = 0  # their bytes (decode_expert_bytes counts what came from the disk)
    # speculative decoding (prompt lookup, a draft model): verify passes, the drafted tokens they checked and those they took
    verify_passes: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def prefill_tps(self) -> float:
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        # the first token comes out of prefill; decode covers the ones after it
        steps = self.generated_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0

    @property
    def expert_bytes_per_token(self) -> float:
        steps = self.generated_tokens - 1
        return self.decode_expert_bytes / steps if steps > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(prefill_tps=self.prefill_tps, decode_tps=self.decode_tps,
                 expert_bytes_per_token=self.expert_bytes_per_token)
        return d

    def _cache_part(self) -> str:
        if not self.expert_cache:
            return ""
        steps = max(self.generated_tokens - 1, 1)
        return (f" | expert cache {self.decode_cache_hits / steps:.1f} hits, "
                f"{self.decode_cache_bytes / steps / 2**20:.2f} MiB/token ({self.expert_cache})")

    def add_stage(self, before, after) -> None:
        """The staged layers' share of a generation (``before``/``after``: the Stager's
        ``StageStats`` at its start and end): stall per decode step, and the quality guard's
        mean recall per layer."""
        if after.steps_run > before.steps_run:
            steps = after.steps_run - before.steps_run
            self.stall_ms_per_step = 1e3 * (after.stall_seconds - before.stall_seconds) / steps
        if after.guard_recall:
            self.guard_recall = {l: sum(v) / len(v) for l, v in after.guard_recall.items()}

    def line(self) -> str:
        mib = 1024 * 1024
        return (f"prefill {self.prefill_tps:.1f} tok/s ({self._prefill_count()}) | "
                f"decode {self.decode_tps:.1f} tok/s ({self.generated_tokens} tok) | "
                f"peak MLX active {self.peak_active_memory / mib:.1f} MiB | "
                f"peak RSS {self.peak_rss / mib:.1f} MiB | "
                f"expert reads {self.expert_bytes_per_token / mib:.2f} MiB/token" + self._cache_part() + " | "
                f"stall {self.stall_ms_per_step:.1f} ms/step"
                + (f" | guard recall@k {sum(self.guard_recall.values()) / len(self.guard_recall):.3f}"
                   if self.guard_recall else "")
                + f" | compute {self.compute_dtype}" + (f" | kernels {self.kernels}" if self.kernels else "")
                + f" | heads {self.heads or 'none'} | adapter {self.adapter or 'none'}"
                + f" | reads {self.reads}" + self._pipeline_part() + self._drafts_part())

    def _prefill_count(self) -> str:
        """The prompt tokens prefilled (what ``prefill_tps`` divides), and those the prompt
        cache held: mlx_lm.generate's ``Prompt: N tokens`` line counts the same N."""
        computed = f"{self.prompt_tokens - self.cached_tokens} tok"
        return computed + (f", {self.cached_tokens} more from the prompt cache" if self.cached_tokens else "")

    def _drafts_part(self) -> str:
        """Prompt lookup's share: drafts taken of those checked, and the tokens a decode
        forward pass made (each verify pass makes the drafts it took and one more)."""
        if not self.verify_passes:
            return ""
        steps = self.generated_tokens - 1 - self.accepted_tokens  # forward passes after the first token
        return (f" | drafts {self.accepted_tokens}/{self.draft_tokens} taken "
                f"({self.accepted_tokens / max(1, self.draft_tokens):.0%}), "
                f"{(self.generated_tokens - 1) / max(1, steps):.2f} tokens a pass")

    def _pipeline_part(self) -> str:
        if not self.pipeline:
            return ""
        steps = max(self.generated_tokens - 1, 1)
        per = ", ".join(f"rank {r} {b / steps / 2**20:.2f}" for r, b in enumerate(self.rank_expert_bytes or []))
        return f" | {self.pipeline}, expert reads MiB/token: {per}"
