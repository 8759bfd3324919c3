"""EngineConfig: the typed settings of an Edge0 engine.

One frozen dataclass; every field has a default and a comment. It can be built from
Python, a TOML file, environment variables and CLI flags (``edge0.config_sources``),
and every value is validated here, whichever way it came.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from edge0.errors import ConfigError

COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")
PATHS = ("exact", "staged", "hot", "whole_layer")
PREFILL_PATHS = ("exact", "hot", "whole_layer")  # staging needs the routing a token ahead
LOG_LEVELS = ("debug", "info", "warning", "error")
PHASES = ("prefill", "decode")
LOG_FORMATS = ("console", "json")
STAGED_SOURCES = ("auto", "oracle", "prerouter")
PREROUTER_MODES = ("auto", "on", "off")
ROUTINGS = ("auto", "replace", "select")
AUTO_ON_OFF = ("auto", "on", "off")
PREROUTER_DTYPES = ("auto", "float16", "float32")
PREROUTER_FLUSHES = ("auto", "mlx", "numpy")
PIPELINES = ("auto", "off")
KERNELS = ("auto", "edge0", "mlx")
JSON_WHITESPACES = ("compact", "flexible")
KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize takes


@dataclass(frozen=True)
class EngineConfig:
    # Activation dtype. "auto": float32 on MLX's CPU backend (its quantized matmul with bf16
    # activations is about 8x slower), the checkpoint's own dtype on GPU backends.
    # mlx_lm.generate computes in the checkpoint's dtype: bfloat16 reproduces its output.
    compute_dtype: str = "auto"
    # Experts the exact path's bundle holds at once; a prefill needing more distinct experts
    # loops over expert chunks. Memory: bundle_capacity x bytes per expert.
    bundle_capacity: int = 32
    # Threads issuing positional reads of expert byte ranges.
    reader_threads: int = 2
    # Expert reads with O_DIRECT (Linux), bypassing the page cache: whole pages straight into
    # the slots where the checkpoint's layout allows, else through a bounce buffer: "on",
    # "off", or "auto" (on when the checkpoint is larger than the memory this process may
    # use: physical memory or its cgroup's limit). A filesystem that refuses O_DIRECT
    # (tmpfs) is read buffered, with one log line.
    direct_io: str = "auto"
    # Prompt tokens per prefill forward pass (as mlx-lm's prefill_step_size). While other
    # generations decode, new ones prefill about that many tokens between two of their steps.
    prefill_step_size: int = 2048
    # While generations decode, the most of the compute thread's time, in percent, new
    # prompts' prefill may take (1-100): 50 = decoding streams get at least half, so their
    # steps at most about double while a long prompt prefills; 100 = prefill every step,
    # within prefill_step_size tokens (chunks are delayed, never cut: tokens unchanged).
    prefill_share: int = 100
    # Generations decoding together, one forward pass per step for all of them (continuous
    # batching; mlx-lm's --decode-concurrency); more wait their turn. 1: one at a time.
    max_batch: int = 16
    # KV cache quantization (mlx-lm's --kv-bits): a generation's attention cache is quantized
    # to this many bits once it holds quantized_kv_start tokens (None: off). Such a generation
    # runs alone (a quantized cache cannot share a batch); one that never reaches the start batches.
    kv_bits: int | None = None
    # The group size of that quantization (mlx-lm's --kv-group-size): it must divide the
    # attention's head size.
    kv_group_size: int = 64
    # Tokens a generation's cache holds before it is quantized (mlx-lm's --quantized-kv-start).
    quantized_kv_start: int = 5000
    # Executor path of every MoE layer at decode (one-token steps): exact, staged, hot or
    # whole_layer. Layers a prerouter head predicts decode staged whatever this says.
    decode_path: str = "exact"
    # Executor path of every MoE layer at prefill (several tokens): exact, hot or
    # whole_layer (every expert of a layer, one read per stacked tensor).
    prefill_path: str = "exact"
    # Per-layer exceptions to the two paths above, each LAYER:PHASE=PATH (e.g. 3:decode=hot);
    # from Python a tuple of (layer, phase, path) triples.
    layer_paths: tuple[tuple[int, str, str], ...] = ()
    # Staged layers: slots per layer (0 = 2 x k: double buffered). Must be >= k.
    slots_per_layer: int = 0
    # Staged layers: MiB the slots of all staged layers together may grow to when a batch's
    # union of experts outgrows a layer's slots (each layer up to an equal share, at most its
    # experts; back to slots_per_layer when the batch empties; never past memory_budget_mb
    # when that is set). None = 4 x the slots' memory at open, within a quarter of the memory
    # the process may use (physical or its cgroup's limit); 0 = never grow (a layer whose
    # union does not fit runs exact for that step).
    slot_budget_mb: int | None = None
    # Staged layers: how many layer reads the scheduler may run ahead of compute.
    prefetch_depth: int = 4
    # Where a staged layer's routing comes from before the step: "prerouter" (the heads'
    # prediction IS the routing), "oracle" (recorded), or "auto" (oracle_file if set, else
    # the prerouter).
    staged_source: str = "auto"
    # Oracle routing recorded by `edge0 record-routing` (the same model, prompt and sampling):
    # staged layers replay it instead of the prerouter's prediction (staged_source auto/oracle).
    oracle_file: str | None = None
    # Prerouter heads: "auto" uses prerouter.safetensors when the model directory has one
    # (its consumer layers then decode staged), "on" requires it, "off" ignores it.
    prerouter: str = "auto"
    # A heads file elsewhere than <model>/prerouter.safetensors.
    prerouter_file: str | None = None
    # Dtype the heads run in when they flush in MLX: "auto" = float16 (as stored) on GPU
    # backends, float32 on the CPU backend, where a float16 flush of 11 heads at 35B shapes
    # measured 86 ms vs 15 ms.
    prerouter_dtype: str = "auto"
    # Where the heads' one flush per decode step runs: "mlx" (on MLX's device, in
    # prerouter_dtype), "numpy" (float32 NumPy products, NumPy's BLAS held to one thread
    # during the flush: a flush of 39 heads at 35B shapes measured 16 ms against MLX's 40 ms
    # on the CPU backend, 48 against 975 ms for 16 rows), or "auto" = numpy on the CPU
    # backend (where NumPy's OpenBLAS thread count can be set and prerouter_dtype is
    # float32), else mlx.
    prerouter_flush: str = "auto"
    # How a staged layer routes on the heads' prediction: "replace" (the prediction IS the
    # routing: k experts staged), "select" (the top k + stage_extra predicted experts are
    # staged and the layer's own router chooses its k among them: nothing read outside the
    # staged set, no host sync), or "auto" (what the heads file records; replace when it
    # records nothing).
    routing: str = "auto"
    # Select routing: experts staged beyond k per staged layer (None = what the heads file
    # records, else k). Slots default to 2 x (k + stage_extra), at most the layer's experts.
    stage_extra: int | None = None
    # Quality guard: every N decode steps, also run the true router of the staged layers and
    # log recall@k of the prediction (0 = off, costs nothing).
    guard_every: int = 0
    # Routing width: serve with this many experts per token instead of config.json's
    # num_experts_per_tok (heads and adapters must have been trained for it). None = as stored.
    experts_per_token: int | None = None
    # Recovery LoRA adapter: "auto" uses <model>/adapter/ when present, "off" none, or an
    # adapter directory (mlx-lm's layout: adapters.safetensors + adapter_config.json).
    adapter: str = "auto"
    # More adapter directories kept resident beside the default one, each selectable per
    # generation by its directory name (the base is never reloaded to switch).
    extra_adapters: tuple[str, ...] = ()
    # Threads (cores) the compute is split over. On Edge0's kernels each quantized matmul
    # splits its output rows over that many threads of the kernels' pool; on MLX's, every
    # expert stack call is cut into that many groups of expert slots, and every large
    # quantized projection (attention, shared experts, head) into that many groups of output
    # rows, each group on its own stream, put back in order. Either way each output is
    # computed as with one thread, so outputs are bit-identical. 0 = every core this process
    # may run on (its CPU affinity) on the CPU backend, 1 on GPU backends.
    compute_threads: int = 0
    # Which kernels compute the quantized matmuls (routed experts, attention, shared experts,
    # lm_head, quantized routers): "edge0" (Edge0's own CPU kernels, edge0/backend/mlx/kernels: output
    # rows split over compute_threads threads; float32 activations), "mlx" (MLX's, bit for
    # bit mlx-lm's numbers), or "auto" = edge0 on MLX's CPU device with compute_dtype float32
    # when the kernels are built, else mlx.
    kernels: str = "auto"
    # Hot path: resident experts per layer (LRU).
    hot_experts: int = 16
    # Refuse to open when slots + bundle + hot sets + whole-layer buffers exceed this (MiB).
    memory_budget_mb: int | None = None
    # Keep the KV caches of finished generations, up to this many MiB (LRU), and reuse one
    # when a prompt extends its tokens (the next turn of a chat): only the new tokens are
    # prefilled. 0 = off.
    prompt_cache_mb: int = 0
    # JSON written under response_format: "compact" (no whitespace between tokens, as
    # json.dumps(separators=(",", ":")) writes it) or "flexible" (any JSON whitespace, at
    # most 40 characters in a row: a model may pretty-print, and may spend tokens on it).
    json_whitespace: str = "compact"
    # Under mlx.launch with more than one rank: "auto" splits the decoder layers over the
    # ranks (pipeline parallelism: each rank holds and streams its own layers), "off" runs
    # the whole model on every rank. One process: nothing to split.
    pipeline: str = "auto"
    # The pipeline's layer ranges, one per rank in rank order, e.g. "0-3,4-7" (None = cut
    # where the checkpoint's bytes per layer come closest to an equal share).
    pipeline_layers: str | None = None
    # Under a pipeline: the longest a generation waits for its next token before it fails
    # with DistributedError (a rank that stopped, or a link that broke, without the launcher
    # ending this rank).
    pipeline_timeout_s: int = 300
    # Under a two-rank pipeline with batched decode: 2 splits a batch of two or more
    # generations into two halves that take turns, so that each rank computes one half
    # while the other rank computes the other (docs/DISTRIBUTED.md, "Micro-batches");
    # 1 = the whole batch in each step.
    pipeline_micro_batches: int = 1
    # Structured logs (reads, waits, stalls, steps): "console" (human) or "json" (one
    # object per line), on standard error.
    log_format: str = "console"
    # Log level: debug (every read and wait), info (per step), warning, error.
    log_level: str = "warning"

    def __post_init__(self):
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}")
        for name in ("bundle_capacity", "reader_threads", "prefill_step_size", "prefetch_depth", "hot_experts",
                     "max_batch"):
            _positive(name, getattr(self, name))
        if isinstance(self.prefill_share, bool) or not isinstance(self.prefill_share, int) \
                or not 1 <= self.prefill_share <= 100:
            raise ConfigError(f"prefill_share must be a whole percentage from 1 to 100, got {self.prefill_share!r}")
        if isinstance(self.slots_per_layer, bool) or not isinstance(self.slots_per_layer, int) \
                or self.slots_per_layer < 0:
            raise ConfigError(f"slots_per_layer must be 0 (= 2 x k) or a positive integer, got {self.slots_per_layer!r}")
        for name in ("decode_path", "prefill_path"):
            if getattr(self, name) not in PATHS:
                raise ConfigError(f"{name} must be one of {PATHS}, got {getattr(self, name)!r}")
        if self.prefill_path == "staged":
            raise ConfigError("prefill_path 'staged' is not supported: staging needs the routing one token "
                              "ahead; use 'whole_layer' or 'exact' for prefill")
        object.__setattr__(self, "layer_paths", tuple(tuple(x) for x in self.layer_paths))
        for entry in self.layer_paths:
            if len(entry) != 3:
                raise ConfigError(f"layer_paths entries are (layer, phase, path), got {entry!r}")
            layer, phase, path = entry
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise ConfigError(f"layer_paths: layer must be a non-negative integer, got {layer!r}")
            if phase not in PHASES:
                raise ConfigError(f"layer_paths: phase must be one of {PHASES}, got {phase!r}")
            if path not in PATHS or (phase == "prefill" and path == "staged"):
                raise ConfigError(f"layer_paths: path {path!r} is not valid for {phase}")
        if self.staged_source not in STAGED_SOURCES:
            raise ConfigError(f"staged_source must be one of {STAGED_SOURCES}, got {self.staged_source!r}")
        if self.prerouter not in PREROUTER_MODES:
            raise ConfigError(f"prerouter must be one of {PREROUTER_MODES}, got {self.prerouter!r}")
        if self.prerouter_dtype not in PREROUTER_DTYPES:
            raise ConfigError(f"prerouter_dtype must be auto, float16 or float32, got {self.prerouter_dtype!r}")
        _positive("pipeline_timeout_s", self.pipeline_timeout_s)
        if self.pipeline_micro_batches not in (1, 2) or isinstance(self.pipeline_micro_batches, bool):
            raise ConfigError(f"pipeline_micro_batches must be 1 (off) or 2, got {self.pipeline_micro_batches!r}")
        if self.pipeline not in PIPELINES:
            raise ConfigError(f"pipeline must be auto or off, got {self.pipeline!r}")
        if self.prerouter_flush not in PREROUTER_FLUSHES:
            raise ConfigError(f"prerouter_flush must be auto, mlx or numpy, got {self.prerouter_flush!r}")
        if self.routing not in ROUTINGS:
            raise ConfigError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.stage_extra is not None and (isinstance(self.stage_extra, bool) or not isinstance(
                self.stage_extra, int) or self.stage_extra < 0):
            raise ConfigError(f"stage_extra must be None (the heads' choice) or a non-negative integer, got "
                              f"{self.stage_extra!r}")
        if self.routing == "replace" and self.stage_extra:
            raise ConfigError(f"stage_extra={self.stage_extra} applies to routing 'select'; routing 'replace' "
                              "stages exactly the predicted k")
        if isinstance(self.guard_every, bool) or not isinstance(self.guard_every, int) or self.guard_every < 0:
            raise ConfigError(f"guard_every must be 0 (off) or a positive integer, got {self.guard_every!r}")
        if self.experts_per_token is not None:
            _positive("experts_per_token", self.experts_per_token)
        if isinstance(self.compute_threads, bool) or not isinstance(self.compute_threads, int) \
                or not 0 <= self.compute_threads <= 64:
            raise ConfigError(f"compute_threads must be 0 (auto) or 1..64, got {self.compute_threads!r}")
        if isinstance(self.prompt_cache_mb, bool) or not isinstance(self.prompt_cache_mb, int) \
                or self.prompt_cache_mb < 0:
            raise ConfigError(f"prompt_cache_mb must be 0 (off) or a positive integer, got {self.prompt_cache_mb!r}")
        if not isinstance(self.adapter, str) or not self.adapter:
            raise ConfigError(f"adapter must be 'auto', 'off' or an adapter directory, got {self.adapter!r}")
        object.__setattr__(self, "extra_adapters", tuple(self.extra_adapters))
        if not all(isinstance(a, str) and a for a in self.extra_adapters):
            raise ConfigError(f"extra_adapters must be adapter directories, got {self.extra_adapters!r}")
        if self.memory_budget_mb is not None:
            _positive("memory_budget_mb", self.memory_budget_mb)
        if self.slot_budget_mb is not None and (isinstance(self.slot_budget_mb, bool) or not isinstance(
                self.slot_budget_mb, int) or self.slot_budget_mb < 0):
            raise ConfigError(f"slot_budget_mb must be None (4 x the slots at open), 0 (never grow) or a positive "
                              f"number of MiB, got {self.slot_budget_mb!r}")
        _check_kv(self)
        for name, choices in (("kernels", KERNELS), ("direct_io", AUTO_ON_OFF), ("json_whitespace", JSON_WHITESPACES),
                              ("log_format", LOG_FORMATS), ("log_level", LOG_LEVELS)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name} must be {', '.join(choices[:-1])} or {choices[-1]}, "
                                  f"got {getattr(self, name)!r}")

    def path_for(self, layer: int, phase: str) -> str:
        for l, p, path in self.layer_paths:
            if l == layer and p == phase:
                return path
        return self.decode_path if phase == "decode" else self.prefill_path

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _check_kv(c: EngineConfig) -> None:
    if c.kv_bits is not None and c.kv_bits not in KV_BITS:
        raise ConfigError(f"kv_bits must be None (off) or one of {', '.join(map(str, KV_BITS))}, got {c.kv_bits!r}")
    if c.kv_group_size not in (32, 64, 128):
        raise ConfigError(f"kv_group_size must be 32, 64 or 128, got {c.kv_group_size!r}")
    if isinstance(c.quantized_kv_start, bool) or not isinstance(c.quantized_kv_start, int) or c.quantized_kv_start < 0:
        raise ConfigError(f"quantized_kv_start must be a non-negative integer, got {c.quantized_kv_start!r}")
