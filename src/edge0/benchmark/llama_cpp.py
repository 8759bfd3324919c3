"""The ``llama.cpp`` bench arm: the peer a Linux user runs when the model does not fit.

llama.cpp maps the GGUF file and lets the page cache do the rest: every expert a token
routes to is read by a page fault the first time it is touched, and kept while memory
lasts. The arm runs llama.cpp's own decode (``llama-cpp-python``, its ctypes binding, with
the library it builds) on the bench checkpoint converted to GGUF (``to_gguf``: the same
weights in Q4_1), with the harness's protocol: the same prompt prefilled, the same
continuation fed back one token per step, the page cache evicted or warmed before the run,
the same memory cgroup. What it reads is what the kernel fetched for the process from the
disk (``/proc/self/io`` ``read_bytes``: every weight, since it maps the whole file), and its
time in page faults is not separable from compute: its step is both.

Settings (``--arm-option llama.cpp:...`` is for Edge0 engines; these come from the
harness): ``gguf_file``, ``llama_threads`` (default: every core, as llama.cpp's own
default), ``llama_mmap`` (default on: a model larger than memory needs it).
"""

from __future__ import annotations

import os
import resource
import time

from edge0.benchmark.machine import proc_read_bytes

INSTALL = ("the llama.cpp arm needs llama-cpp-python and gguf: pip install 'edge0[llamacpp]' "
           "(pip builds llama.cpp from its source package: about 20 minutes on 2 cores)")


def available() -> str | None:
    """None when the arm can run here, else what is missing."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"{INSTALL} ({e})"
    return None


def build_features(llama_cpp) -> list[str]:
    """The CPU features the llama.cpp build uses (its system info's ``NAME = 1`` entries)."""
    info = llama_cpp.llama_print_system_info()
    text = info.decode() if isinstance(info, bytes) else str(info)
    return [name.split(":")[-1].strip() for name, _, on in (part.partition("=") for part in text.split("|"))
            if on.strip() == "1"]


def _status_kib(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _last_logits(llm, n_vocab: int):
    import numpy as np

    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))


def replay(name: str, prompt: list[int], continuation: list[int], settings: dict) -> dict:
    """Run llama.cpp over the replay sequence; the figures ``arms.replay`` gives (those
    llama.cpp has no counterpart for are None), with ``argmax``, its greedy token at every
    position, in place of the digests (``arms.replay`` makes them)."""
    import llama_cpp

    threads = int(settings.get("llama_threads") or os.cpu_count() or 1)
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=settings["gguf_file"], n_ctx=len(prompt) + len(continuation) + 16,
                          n_batch=max(32, len(prompt)), n_threads=threads, n_threads_batch=threads,
                          use_mmap=bool(settings.get("llama_mmap", True)), verbose=False, seed=0)
    load_seconds = time.perf_counter() - t0
    n_vocab = llm.n_vocab()
    try:
        faults0, read0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt, proc_read_bytes()
        t0 = time.perf_counter()
        llm.eval(prompt)
        prefill_seconds = time.perf_counter() - t0
        argmax = [int(_last_logits(llm, n_vocab).argmax())]
        prefill_bytes = proc_read_bytes() - read0
        steps, step_bytes = [], []
        usage0 = resource.getrusage(resource.RUSAGE_SELF)
        for token in continuation:
            b = proc_read_bytes()
            t0 = time.perf_counter()
            llm.eval([token])
            steps.append(time.perf_counter() - t0)
            step_bytes.append(proc_read_bytes() - b)
            argmax.append(int(_last_logits(llm, n_vocab).argmax()))
        usage = resource.getrusage(resource.RUSAGE_SELF)
        faults = usage.ru_majflt - faults0
        info = {"threads": threads, "mmap": bool(settings.get("llama_mmap", True)), "weights": "Q4_1 (GGUF)",
                "bytes_read": "/proc/self/io read_bytes: every weight the step touched that was not in the page cache",
                "major_faults": faults, "decode_major_faults": usage.ru_majflt - usage0.ru_majflt,
                # where its decode steps' CPU went: user time (its kernels) and system time (page faults:
                # reading the mapped file, and reclaim under a cap)
                "decode_user_s": usage.ru_utime - usage0.ru_utime, "decode_system_s": usage.ru_stime - usage0.ru_stime,
                "rss_anon_mib_at_end": _status_kib("RssAnon") / 1024,
                "rss_file_mib_at_end": _status_kib("RssFile") / 1024,
                "llama_cpp_python": getattr(llama_cpp, "__version__", "?"), "build": build_features(llama_cpp)}
    finally:
        llm.close()
    return dict(
        arm=name, settings=settings, info=info, load_seconds=load_seconds,
        prompt_tokens=len(prompt), decode_tokens=len(continuation),
        argmax=argmax,
        prefill_tps=len(prompt) / prefill_seconds, decode_tps=len(continuation) / sum(steps),
        step_ms=[s * 1e3 for s in steps], step_ms_median=1e3 * sorted(steps)[len(steps) // 2],
        read_wait_ms_per_step=None, expert_bytes_per_token=sum(step_bytes) / len(steps),
        disk_bytes_per_token=sum(step_bytes) / len(steps),
        prefill_expert_bytes=prefill_bytes, peak_active_memory=None,
        peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, total_wait_ms=None,
    )
