"""Arrays, dtypes, evaluation and memory counters (MLX)."""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import numpy as np

from edge0.errors import ConfigError

Array = mx.array

# Re-exported ops: routing and the executors use exactly mlx's own functions so that
# their results are bit-identical to mlx-lm's model code.
argpartition = mx.argpartition
argsort = mx.argsort
array = mx.array
compile = mx.compile
flatten = mx.flatten
sigmoid = mx.sigmoid
softmax = mx.softmax
stop_gradient = mx.stop_gradient
take = mx.take
take_along_axis = mx.take_along_axis
zeros = mx.zeros
eye = mx.eye
where = mx.where
ones = mx.ones
maximum = mx.maximum
expand_dims = mx.expand_dims
concatenate = mx.concatenate
broadcast_to = mx.broadcast_to
logical_or = mx.logical_or
logical_not = mx.logical_not
logsumexp = mx.logsumexp

float32 = mx.float32
int32 = mx.int32
uint32 = mx.uint32

DTYPES = {
    "float32": mx.float32,
    "bfloat16": mx.bfloat16,
    "float16": mx.float16,
}

# safetensors dtype names -> mlx dtypes (for tensors Edge0 reads itself)
SAFETENSORS_DTYPES = {
    "U8": mx.uint8, "I8": mx.int8, "U16": mx.uint16, "I16": mx.int16,
    "U32": mx.uint32, "I32": mx.int32, "U64": mx.uint64, "I64": mx.int64,
    "F16": mx.float16, "BF16": mx.bfloat16, "F32": mx.float32, "BOOL": mx.bool_,
}


# Host syncs Edge0's own code performs (mx.eval, device -> host copies), by kind. Tests
# read it to prove that a staged decode step needs none per layer.
SYNCS = {"eval": 0, "to_host": 0}


def eval(*arrays) -> None:
    """Evaluate ``arrays`` and wait for them: a host sync."""
    SYNCS["eval"] += 1
    mx.eval(*arrays)


def async_eval(*arrays) -> None:
    """Schedule ``arrays`` for evaluation and return at once: not a host sync."""
    mx.async_eval(*arrays)


def evaluated(x) -> bool:
    """Whether ``x`` has been computed (no sync; False where that cannot be told: the
    caller evaluates it)."""
    return _EVALUATED is not None and _EVALUATED(x)


def _ext_function(name: str):
    """The kernels' extension's function ``name``, or None where it is not built."""
    from edge0.backend.mlx.kernels import _loader
    return getattr(_loader.ext(), name) if _loader.available() else None


def to_host(x) -> np.ndarray:
    """Copy ``x`` to a NumPy array: a host sync."""
    SYNCS["to_host"] += 1
    return np.array(x)


def is_cpu() -> bool:
    return mx.default_device() == mx.cpu


_THREAD_STREAMS = threading.local()


def compute_streams(n: int) -> list:
    """``n`` streams of the calling thread on the default device: its default stream and
    ``n - 1`` more. MLX runs each CPU stream on its own thread, so ops on different streams
    of one graph run on different cores. Streams belong to the thread that made them, so
    each thread gets its own, made once and reused by every engine that runs on it (MLX
    keeps an OS thread per stream for the life of the process)."""
    device = mx.default_device()
    extra = getattr(_THREAD_STREAMS, "extra", None)
    if extra is None or _THREAD_STREAMS.device != device:
        extra = _THREAD_STREAMS.extra = []
        _THREAD_STREAMS.device = device
    while len(extra) < n - 1:
        extra.append(mx.new_stream(device))
    return [mx.default_stream(device)] + extra[:n - 1]


def on_stream(stream):
    """``with on_stream(s):`` ops built inside run on stream ``s``."""
    return mx.stream(stream)


def dtype(name: str):
    """The compute dtype called ``name`` ('float32', 'bfloat16', 'float16')."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"compute_dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def active_memory() -> int:
    return mx.get_active_memory()


def cache_memory() -> int:
    """Bytes of freed buffers MLX keeps for reuse (``trim_buffer_cache`` bounds them)."""
    return mx.get_cache_memory()


def peak_memory() -> int:
    return mx.get_peak_memory()


def reset_peak_memory() -> None:
    mx.reset_peak_memory()


def clear_cache() -> None:
    mx.clear_cache()


BUFFER_CACHE_BYTES = 256 * 2**20


def trim_buffer_cache(limit: int | None = None) -> None:
    """Give back MLX's cache of freed buffers when it holds more than ``limit`` bytes
    (``BUFFER_CACHE_BYTES``): what a finished generation freed (an evicted prompt-cache
    entry, its activations) is reused by the next one up to that, and returned beyond it,
    so the process's memory follows what is live, the prompt cache's bound included."""
    if mx.get_cache_memory() > (BUFFER_CACHE_BYTES if limit is None else limit):
        mx.clear_cache()


def seed(value: int) -> None:
    mx.random.seed(value)


def draw_key(seed: int, step: int):
    """The random key of a row's draw at ``step``: the row's own stream, (seed, step) -> key,
    the same whichever rows share its batch and wherever it runs (every rank of a pipeline
    draws alike). MLX's random state (the thread's) is neither read nor changed."""
    return mx.random.key(hash((seed, step)) & (2**63 - 1))


def sample(logprobs, key, *, temp: float, before: tuple = (), xtc: tuple | None = None, top_k: tuple | None = None):
    """One token of each row of ``logprobs`` [1, V], mlx-lm's ``make_sampler`` chain (built by
    ``nn.row_sampling``: ``before``, its deterministic filters as (function, arguments); XTC's
    (probability, threshold, special tokens); top-k's (function, k); then a categorical draw
    at ``temp``, or greedy at 0) with every random draw from ``key`` instead of MLX's random
    state: with ``key`` the one ``mx.random.seed(s)`` sets, the token is ``make_sampler``'s
    right after that seed, bit for bit (XTC's draw takes the key's first split, the
    categorical draw the next, as the seeded stream would)."""
    if temp == 0:
        return mx.argmax(logprobs, axis=-1)
    for f, args in before:
        logprobs = f(logprobs, *args)
    if xtc is not None:
        key, sub = mx.random.split(key)
        logprobs = _xtc(logprobs, *xtc, sub)
    if top_k is not None:
        logprobs = top_k[0](logprobs, top_k[1])
    _, sub = mx.random.split(key)
    return mx.random.categorical(logprobs * (1.0 / temp), key=sub)


def _xtc(logits, probability: float, threshold: float, special: list, key):
    """XTC ("exclude top choices"): with ``probability`` (one draw from ``key`` per step),
    every token whose probability is above ``threshold`` is masked out except the least
    likely of them; the ``special`` tokens are never masked."""
    probs = mx.softmax(logits, -1)
    least_over = mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    drop = probs > least_over
    if special:
        drop[..., special] = False
    return mx.where(mx.random.uniform(0, 1, key=key) > probability, logits, mx.where(drop, -mx.inf, logits))


def one_hot_k(inds, num: int, dtype=mx.float32):
    """[..., k] expert indices -> [..., num] multi-hot."""
    return (mx.expand_dims(inds, -1) == mx.arange(num)).any(axis=-2).astype(dtype)


def save_safetensors(path: str, arrays: dict, metadata: dict) -> None:
    mx.save_safetensors(path, arrays, metadata=metadata)


def load_safetensors(path: str) -> tuple[dict, dict]:
    return mx.load(path, return_metadata=True)


concat = mx.concatenate
stack = mx.stack
full = mx.full
float16 = mx.float16
log_softmax = lambda x, axis=-1: x - mx.logsumexp(x, axis=axis, keepdims=True)


def score_tokens(logits, targets):
    """How a model scores text (lazy): ``logits`` [..., n, vocab], where position i predicts
    the token after it, and ``targets`` [..., n], those next tokens. Returns (the
    log-softmax of the logits in float32, natural log; each target's log-probability
    [..., n]). ``edge0 eval`` and the engine's prompt scoring both read text through this."""
    logp = log_softmax(logits.astype(mx.float32))
    return logp, mx.take_along_axis(logp, targets[..., None], axis=-1).squeeze(-1)


def top_tokens(logp, k: int):
    """The ``k`` most likely token ids at each position of ``logp`` [..., vocab] and their
    log-probabilities, both [..., k] (lazy; in no particular order)."""
    ids = mx.argpartition(-logp, kth=k - 1, axis=-1)[..., :k]
    return ids, mx.take_along_axis(logp, ids, axis=-1)


class ReadyFlags:
    """One readiness flag per (staged layer, step parity): the reader that fills a layer's
    slots stores the step's ticket in its flag (``set``), and the layer's computation, built
    into the step's graph, waits for it where the gated arrays are consumed (``gate``): Edge0's
    slot-wait primitive, which the kernels' extension holds (on MLX's kernels too). Without
    the extension ``gate`` waits in the calling thread instead (the layers below scheduled
    first). ``waited`` accumulates, per flag, the nanoseconds computation waited."""

    POLL_S = 50e-6

    def __init__(self, n: int, timeout_s: float):
        self.timeout_s = timeout_s
        self.flags = mx.zeros((n,), dtype=mx.int32)
        self.waited = mx.zeros((n,), dtype=mx.int64)
        mx.eval(self.flags, self.waited)
        self.host = np.array(self.flags, copy=False)
        self.waited_host = np.array(self.waited, copy=False)
        self._wait = _ext_function("wait_flag") if mx.default_device() == mx.cpu else None

    @property
    def in_graph(self) -> bool:
        """Whether ``gate`` waits inside the graph (else in the calling thread)."""
        return self._wait is not None

    def set(self, index: int, value: int) -> None:
        """From any thread: flag ``index`` holds ``value`` (a ticket; its negative: failed)."""
        self.host[index] = value

    def gate(self, x, index: int, value: int):
        """``x``, once flag ``index`` holds ``value``: what consumes the result waits for it
        (raises at evaluation when the flag holds ``-value`` or after ``timeout_s``)."""
        if self._wait is not None:
            return self._wait(x, self.flags, self.waited, index, value, self.timeout_s)
        mx.async_eval(x)  # the layers below run meanwhile
        self.wait(index, value)
        return x

    def wait(self, index: int, value: int) -> None:
        """Wait in this thread until flag ``index`` holds ``value`` (raises as ``gate`` does)."""
        t0 = time.perf_counter()
        while (got := int(self.host[index])) != value:
            if got == -value:
                raise RuntimeError(f"edge0: the slots of staged layer #{index} failed to load")
            if time.perf_counter() - t0 > self.timeout_s:
                raise RuntimeError(f"edge0: the slots of staged layer #{index} were not ready after {self.timeout_s:g} s")
            time.sleep(self.POLL_S)
        self.waited_host[index] += int(1e9 * (time.perf_counter() - t0))

    def waited_ns(self) -> np.ndarray:
        """Nanoseconds waited per flag so far (final for every step evaluated)."""
        return self.waited_host.copy()


_EVALUATED = _ext_function("evaluated")
