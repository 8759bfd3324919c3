"""EngineConfig: the typed settings of an Edge0 engine.

One frozen dataclass; every field is a ``setting``: its default, its doc (the CLI's help
and docs/CONFIG.md's table) and what it takes (choices, or integer bounds and what None
means), all in the field's metadata and checked in one loop. It can be built from Python,
a TOML file, environment variables and CLI flags (``edge0.config_sources``), and every value
is validated here, whichever way it came.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields

from edge0.drafts import MAX_DRAFT
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
PREROUTER_FLUSHES = ("auto", "edge0", "mlx", "numpy")
PIPELINES = ("auto", "off")
KERNELS = ("auto", "edge0", "mlx")
JSON_WHITESPACES = ("compact", "flexible")
KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize takes




def setting(default, doc: str, *, choices: tuple = (), lo: int | None = None, hi: int | None = None,
            none: str | None = None, why: str | None = None):
    """An EngineConfig field: its ``default`` and ``doc``; the values it takes: one of
    ``choices``, or an integer from ``lo`` (to ``hi``); what None means where the type allows
    it (``none``); ``why``: what the refusal says it must be, where the rule says it better."""
    return field(default=default, metadata={"doc": doc, "choices": choices, "lo": lo, "hi": hi, "none": none,
                                            "why": why})


@dataclass(frozen=True)
class EngineConfig:
    compute_dtype: str = setting(
        "auto",
        "Activation dtype. \"auto\": float32 on MLX's CPU backend (its quantized matmul with bf16 activations is "
        "about 8x slower), the checkpoint's own dtype on GPU backends. mlx_lm.generate computes in the "
        "checkpoint's dtype: bfloat16 reproduces its output.",
        choices=COMPUTE_DTYPES)
    bundle_capacity: int = setting(
        32,
        "Experts the exact path's bundle holds at once; a prefill needing more distinct experts loops over expert "
        "chunks. Memory: bundle_capacity x bytes per expert.",
        lo=1)
    reader_threads: int = setting(
        2,
        "Threads issuing positional reads of expert byte ranges.",
        lo=1)
    direct_io: str = setting(
        "auto",
        "Expert reads with O_DIRECT (Linux), bypassing the page cache: whole pages straight into the slots where "
        "the checkpoint's layout allows, else through a bounce buffer: \"on\", \"off\", or \"auto\" (on when the "
        "checkpoint is larger than the memory this process may use: physical memory or its cgroup's limit). A "
        "filesystem that refuses O_DIRECT (tmpfs) is read buffered, with one log line.",
        choices=AUTO_ON_OFF)
    prefill_step_size: int = setting(
        2048,
        "Prompt tokens per prefill forward pass (as mlx-lm's prefill_step_size). While other generations decode, "
        "new ones prefill about that many tokens between two of their steps.",
        lo=1)
    prefill_share: int = setting(
        100,
        "While generations decode, the most of the compute thread's time, in percent, new prompts' prefill may "
        "take (1-100): 50 = decoding streams get at least half, so their steps at most about double while a long "
        "prompt prefills; 100 = prefill every step, within prefill_step_size tokens (chunks are delayed, never "
        "cut: tokens unchanged).",
        lo=1, hi=100, why="a whole percentage from 1 to 100")
    max_batch: int = setting(
        16,
        "Generations decoding together, one forward pass per step for all of them (continuous batching; mlx-lm's "
        "--decode-concurrency); more wait their turn. 1: one at a time.",
        lo=1)
    kv_bits: int | None = setting(
        None,
        "KV cache quantization (mlx-lm's --kv-bits): a generation's attention cache is quantized to this many "
        "bits once it holds quantized_kv_start tokens (None: off). Such a generation runs alone (a quantized "
        "cache cannot share a batch); one that never reaches the start batches.",
        choices=KV_BITS, none="off")
    kv_group_size: int = setting(
        64,
        "The group size of that quantization (mlx-lm's --kv-group-size): it must divide the attention's head "
        "size.",
        choices=(32, 64, 128))
    quantized_kv_start: int = setting(
        5000,
        "Tokens a generation's cache holds before it is quantized (mlx-lm's --quantized-kv-start).",
        lo=0)
    decode_path: str = setting(
        "exact",
        "Executor path of every MoE layer at decode (one-token steps): exact, staged, hot or whole_layer. Layers "
        "a prerouter head predicts decode staged whatever this says.",
        choices=PATHS)
    prefill_path: str = setting(
        "exact",
        "Executor path of every MoE layer at prefill (several tokens): exact, hot or whole_layer (every expert of "
        "a layer, one read per stacked tensor).",
        choices=PREFILL_PATHS)
    layer_paths: tuple[tuple[int, str, str], ...] = setting(
        (),
        "Per-layer exceptions to the two paths above, each LAYER:PHASE=PATH (e.g. 3:decode=hot); from Python a "
        "tuple of (layer, phase, path) triples.")
    slots_per_layer: int = setting(
        0,
        "Staged layers: slots per layer (0 = 2 x k: double buffered; with cache_mb auto and direct reads, more: "
        "the staged layers' share of what the automatic expert cache would get, since a hit in a sticky slot costs "
        "no copy). Must be >= k.",
        lo=0, why="0 (= 2 x k) or a positive integer")
    slot_budget_mb: int | None = setting(
        None,
        "Staged layers: MiB the slots of all staged layers together may grow to when a batch's union of experts "
        "outgrows a layer's slots (each layer up to an equal share, at most its experts; back to slots_per_layer "
        "when the batch empties; never past memory_budget_mb when that is set). None = 4 x the slots' memory at "
        "open, within a quarter of the memory the process may use (physical or its cgroup's limit); 0 = never "
        "grow (a layer whose union does not fit runs exact for that step).",
        lo=0, why="None (4 x the slots at open), 0 (never grow) or a positive number of MiB")
    cache_mb: int | None = setting(
        None,
        "The expert cache: MiB of expert bytes kept in memory beside the slots, filled by the reads the slots, "
        "bundles and hot sets make anyway; an expert it holds is a memory copy, not a read. None (\"auto\"): with "
        "direct reads (the page cache bypassed), what the process may use (physical memory or its cgroup's limit) "
        "less what the memory plan holds for the rest (the process itself, the resident weights, the prerouter "
        "heads, the expert buffers at their ceiling, the KV budget of plan_context and plan_batch) and a margin "
        "(an eighth of that memory, at least 1 GiB), less the staged layers' share (their experts' of those held), "
        "which goes to their slots where slots_per_layer is 0, none when that is under a tenth of the experts; with "
        "buffered reads off (the page cache keeps what was read). 0 = off. Never past its budget. `edge0 plan` "
        "prints the plan.",
        lo=0, none="auto")
    plan_context: int = setting(
        4096,
        "Tokens of context a generation is planned for: the memory plan (`edge0 plan`) keeps room for the KV "
        "caches of plan_batch generations this long before it gives the rest to the automatic expert cache, "
        "and refuses to open where they do not fit.",
        lo=1)
    plan_batch: int = setting(
        1,
        "Generations the memory plan keeps KV cache room for, each plan_context tokens long (see plan_context).",
        lo=1)
    cache_policy: str = setting(
        "lfu",
        "What the expert cache evicts first: \"lfu\" (least frequently used, with dynamic aging: what was used "
        "often long ago ages out) or \"lru\" (least recently used).",
        choices=("lfu", "lru"))
    prefetch_depth: int = setting(
        4,
        "Staged layers: how many layers' reads the scheduler queues at a time, earliest layer first (the next "
        "layer's enter as one is read).",
        lo=1)
    staged_source: str = setting(
        "auto",
        "Where a staged layer's routing comes from before the step: \"prerouter\" (the heads' prediction IS the "
        "routing), \"oracle\" (recorded), or \"auto\" (oracle_file if set, else the prerouter).",
        choices=STAGED_SOURCES)
    oracle_file: str | None = setting(
        None,
        "Oracle routing recorded by `edge0 record-routing` (the same model, prompt and sampling): staged layers "
        "replay it instead of the prerouter's prediction (staged_source auto/oracle).")
    prerouter: str = setting(
        "auto",
        "Prerouter heads: \"auto\" uses prerouter.safetensors when the model directory has one (its consumer "
        "layers then decode staged), \"on\" requires it, \"off\" ignores it.",
        choices=PREROUTER_MODES)
    prerouter_file: str | None = setting(
        None,
        "A heads file elsewhere than <model>/prerouter.safetensors.")
    prerouter_dtype: str = setting(
        "auto",
        "Dtype the heads run in when they flush in MLX: \"auto\" = float16 (as stored) on GPU backends, float32 "
        "on the CPU backend, where a float16 flush of 11 heads at 35B shapes measured 86 ms vs 15 ms.",
        choices=PREROUTER_DTYPES)
    prerouter_flush: str = setting(
        "auto",
        "Where the heads' one flush per decode step runs: \"mlx\" (on MLX's device, in prerouter_dtype), "
        "\"numpy\" (float32 NumPy products, NumPy's BLAS held to one thread during the flush: a flush of 39 heads "
        "at 35B shapes measured 16 ms against MLX's 40 ms on the CPU backend, 48 against 975 ms for 16 rows), or "
        "\"edge0\" (the heads' weights quantized to 8 bits once at open and multiplied on Edge0's kernels, both "
        "cores: a quarter of the bytes a step; its predictions differ from the float32 flushes' by that rounding, "
        "so the routing may too: the demo's perplexity 1.000006x the float32 flush's, tools/flush_quality.py; 11 "
        "heads at 35B shapes 2.0 ms against NumPy's 8.4), or "
        "\"auto\" = on the CPU backend with prerouter_dtype float32: edge0 where kernels resolve to edge0 and "
        "the heads' widths are multiples of 32, else numpy (where NumPy's OpenBLAS thread count can be set); "
        "mlx elsewhere.",
        choices=PREROUTER_FLUSHES)
    routing: str = setting(
        "auto",
        "How a staged layer routes on the heads' prediction: \"replace\" (the prediction IS the routing: k "
        "experts staged), \"select\" (the top k + stage_extra predicted experts are staged and the layer's own "
        "router chooses its k among them: nothing read outside the staged set, no host sync; with stage_extra 0 "
        "it reads what replace reads and weighs the predicted k by the router), or \"auto\" (what the heads file "
        "records, its over-memory choice where the checkpoint is larger than the memory the process may use; "
        "replace when it records nothing).",
        choices=ROUTINGS)
    stage_extra: int | None = setting(
        None,
        "Select routing: experts staged beyond k per staged layer (None = what the heads file records, else k). "
        "Slots default to 2 x (k + stage_extra), at most the layer's experts.",
        lo=0, none="the heads' choice")
    guard_every: int = setting(
        0,
        "Quality guard: every N decode steps, also run the true router of the staged layers and log recall@k of "
        "the prediction (0 = off, costs nothing).",
        lo=0, why="0 (off) or a positive integer")
    experts_per_token: int | None = setting(
        None,
        "Routing width: serve with this many experts per token instead of config.json's num_experts_per_tok "
        "(heads and adapters must have been trained for it). None = as stored.",
        lo=1)
    adapter: str = setting(
        "auto",
        "Recovery LoRA adapter: \"auto\" uses <model>/adapter/ when present, \"off\" none, or an adapter "
        "directory (mlx-lm's layout: adapters.safetensors + adapter_config.json).")
    extra_adapters: tuple[str, ...] = setting(
        (),
        "More adapter directories kept resident beside the default one, each selectable per generation by its "
        "directory name (the base is never reloaded to switch).")
    compute_threads: int = setting(
        0,
        "Threads (cores) the compute is split over. On Edge0's kernels each quantized matmul splits its output "
        "rows over that many threads of the kernels' pool; on MLX's, every expert stack call is cut into that "
        "many groups of expert slots, and every large quantized projection (attention, shared experts, head) into "
        "that many groups of output rows, each group on its own stream, put back in order. Either way each output "
        "is computed as with one thread, so outputs are bit-identical. 0 = every core this process may run on "
        "(its CPU affinity) on the CPU backend, 1 on GPU backends.",
        lo=0, hi=64, why="0 (auto) or 1..64")
    kernels: str = setting(
        "auto",
        "Which kernels compute the quantized matmuls (routed experts, attention, shared experts, lm_head, "
        "quantized routers) and a prompt's attention products (softmax(q k^T) v): \"edge0\" (Edge0's own CPU "
        "kernels, edge0/backend/mlx/kernels: output rows split over compute_threads threads; float32 "
        "activations), \"mlx\" (MLX's, bit for bit mlx-lm's numbers), or "
        "\"auto\" = edge0 on MLX's CPU device with compute_dtype float32 when the kernels are built, else mlx.",
        choices=KERNELS)
    int8_products: str = setting(
        "off",
        "\"on\": on Edge0's kernels, a decode step's products (fewer than 8 rows against an expert's weights, 4 "
        "and 8 bits) quantize x to int8 per 32 values and multiply with AVX-512 VNNI's integer dot products, as "
        "llama.cpp multiplies its q4 weights by q8 activations: at 12 layers of the 35B tier in memory 1.00-1.26x "
        "the decode of the float32 products (four runs), each product's relative error about 5e-3 where the float32 "
        "loops' is "
        "under 1e-6 (the demo's perplexity 1.0006x; docs/KERNELS.md, \"Integer products\"). Needs a CPU with "
        "AVX-512 VNNI (refused elsewhere, and on MLX's kernels). Process-wide, like the kernels' threads: the "
        "engine opened last decides. \"off\": float32 products.",
        choices=("off", "on"))
    prompt_lookup: int = setting(
        0,
        "Speculative decoding by prompt lookup: each decode step drafts up to this many tokens (1-16) from the "
        "prompt and the text so far (what followed the last place the sequence's last tokens occurred) and one "
        "forward pass verifies them: the tokens are those decoding without drafts gives (greedy and sampled, "
        "the same random stream). How many it drafts adapts to what was taken; text that does not repeat pays "
        "no pass. Rows sharing a batch's steps draft each their own (one pass verifies them all, a shorter draft "
        "padded); a generation with a response_format or grammar, a rotating or quantized KV cache, or a routing "
        "recording decodes without drafts. With prerouter heads, each drafted position is routed as a step there "
        "would route it (the heads predict it inside the pass); over slots each staged layer reads the union of "
        "its positions' experts once. A request's prompt_lookup overrides it. 0: off.",
        lo=0, hi=MAX_DRAFT, why=f"0 (off) or the most tokens a step drafts, 1 to {MAX_DRAFT}")
    draft_model: str | None = setting(
        None,
        "Speculative decoding with a draft model (mlx-lm's --draft-model): a checkpoint mlx-lm opens (dense or MoE, "
        "every weight resident, beside the plan's memory), whose tokenizer's vocabulary is the model's. Each "
        "decode step it drafts up to num_draft_tokens tokens greedily on its own KV cache and one forward pass "
        "verifies them: the tokens are those decoding without drafts gives (greedy and sampled). Who drafts, "
        "and how many adapt, as with prompt_lookup, which it cannot be given with. None: none.")
    num_draft_tokens: int = setting(
        3,
        "The draft model's tokens a step at most (mlx-lm's --num-draft-tokens); a request's num_draft_tokens "
        "overrides it (0: no drafts for it).",
        lo=1, hi=MAX_DRAFT, why=f"the most tokens a step drafts, 1 to {MAX_DRAFT}")
    prompt_lookup_ngram: int = setting(
        3,
        "Prompt lookup: the longest run of the sequence's last tokens it looks for (it tries this many, then "
        "fewer, down to two: one repeated token alone drafts mostly what is not taken; until a pass took a "
        "draft, only runs of this many draft).",
        lo=2, hi=8, why="an integer from 2 to 8")
    expert_source: str = setting(
        "auto",
        "Where the routed experts are computed from: \"slots\" (each path reads the experts it needs into its "
        "buffers: the exact bundle, the staged slots, hot sets), \"mapping\" (Edge0's kernels read them where a "
        "read-only mapping of the checkpoint holds them, in the page cache: no read into a buffer and no copy; "
        "every path keeps its routing, hot and whole-layer layers compute as exact), or \"auto\" = mapping "
        "when kernels resolve to edge0, reads are buffered (direct_io off) and the checkpoint's files fit in "
        "memory beside everything else planned, else slots. The stats line says which ran.",
        choices=("auto", "mapping", "slots"))
    unpredicted_layers: str = setting(
        "exact",
        "How the MoE layers no prerouter head predicts (the first) decode while the others decode staged: "
        "\"exact\" (their routing read to the host mid-step, their experts read on demand through the expert "
        "cache: a second host read and the reader threads' hand-offs a step; over the mapping neither: exact reads "
        "nothing there) or \"resident\" (every expert of theirs held in memory, read once at the first step, "
        "planned beside the other buffers and out of an auto expert cache: over slots a step then reads nothing "
        "for them and evaluates once). At 40 layers of the 35B shape under an 8 GiB cap resident decoded at 0.92x "
        "exact (its 425 MiB out of the cache: a tenth more disk bytes a token), so exact is the default.",
        choices=("exact", "resident"))
    hot_experts: int = setting(
        16,
        "Hot path: resident experts per layer (LRU). At least the layer's experts: every one is held, read at "
        "the first step, and the layer never reads its routing to the host (a decode step through it evaluates "
        "once).",
        lo=1)
    memory_budget_mb: int | None = setting(
        None,
        "Refuse to open when slots + bundle + hot sets + whole-layer buffers exceed this (MiB).",
        lo=1)
    prompt_cache_mb: int = setting(
        0,
        "Keep the KV caches of finished generations, up to this many MiB (LRU), and reuse one when a prompt "
        "extends its tokens (the next turn of a chat): only the new tokens are prefilled. 0 = off.",
        lo=0, why="0 (off) or a positive integer")
    json_whitespace: str = setting(
        "compact",
        "JSON written under response_format: \"compact\" (no whitespace between tokens, as "
        "json.dumps(separators=(\",\", \":\")) writes it) or \"flexible\" (any JSON whitespace, at most 40 "
        "characters in a row: a model may pretty-print, and may spend tokens on it).",
        choices=JSON_WHITESPACES)
    pipeline: str = setting(
        "auto",
        "Under mlx.launch with more than one rank: \"auto\" splits the decoder layers over the ranks (pipeline "
        "parallelism: each rank holds and streams its own layers), \"off\" runs the whole model on every rank. "
        "One process: nothing to split.",
        choices=PIPELINES)
    pipeline_layers: str | None = setting(
        None,
        "The pipeline's layer ranges, one per rank in rank order, e.g. \"0-3,4-7\" (None = cut where the "
        "checkpoint's bytes per layer come closest to an equal share).")
    pipeline_timeout_s: int = setting(
        300,
        "Under a pipeline: the longest a generation waits for its next token before it fails with "
        "DistributedError (a rank that stopped, or a link that broke, without the launcher ending this rank).",
        lo=1)
    pipeline_micro_batches: int = setting(
        1,
        "Under a two-rank pipeline with batched decode: 2 splits a batch of two or more generations into two "
        "halves that take turns, so that each rank computes one half while the other rank computes the other "
        "(docs/DISTRIBUTED.md, \"Micro-batches\"); 1 = the whole batch in each step.",
        choices=(1, 2), why="1 (off) or 2")
    log_format: str = setting(
        "console",
        "Structured logs (reads, waits, stalls, steps): \"console\" (human) or \"json\" (one object per line), on "
        "standard error.",
        choices=LOG_FORMATS)
    log_level: str = setting(
        "warning",
        "Log level: debug (every read and wait), info (per step), warning, error.",
        choices=LOG_LEVELS)


    def __post_init__(self):
        if self.prefill_path == "staged":
            raise ConfigError("prefill_path 'staged' is not supported: staging needs the routing one token "
                              "ahead; use 'whole_layer' or 'exact' for prefill")
        hints = _hints()
        for f in fields(self):
            _check_setting(f, getattr(self, f.name), hints[f.name])
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
        if self.routing == "replace" and self.stage_extra:
            raise ConfigError(f"stage_extra={self.stage_extra} applies to routing 'select'; routing 'replace' "
                              "stages exactly the predicted k")
        if not isinstance(self.adapter, str) or not self.adapter:
            raise ConfigError(f"adapter must be 'auto', 'off' or an adapter directory, got {self.adapter!r}")
        object.__setattr__(self, "extra_adapters", tuple(self.extra_adapters))
        if not all(isinstance(a, str) and a for a in self.extra_adapters):
            raise ConfigError(f"extra_adapters must be adapter directories, got {self.extra_adapters!r}")

    def path_for(self, layer: int, phase: str) -> str:
        for l, p, path in self.layer_paths:
            if l == layer and p == phase:
                return path
        return self.decode_path if phase == "decode" else self.prefill_path

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


_HINTS: dict = {}


def _hints() -> dict:
    if not _HINTS:
        _HINTS.update(typing.get_type_hints(EngineConfig))
    return _HINTS


def _either(values: tuple) -> str:
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _check_setting(f, value, hint) -> None:
    """``value`` against its field's rule: one of its choices, or an integer within its
    bounds; None where the type allows it."""
    m = f.metadata
    if value is None and type(None) in typing.get_args(hint):
        return
    if m["choices"]:
        if isinstance(value, bool) or value not in m["choices"]:
            what = m["why"] or (f"None ({m['none']}) or " if m["none"] else "") + _either(m["choices"])
            raise ConfigError(f"{f.name} must be {what}, got {value!r}")
    elif m["lo"] is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < m["lo"] \
                or (m["hi"] is not None and value > m["hi"]):
            base = ("a positive integer" if m["lo"] == 1 and m["hi"] is None else
                    "a non-negative integer" if m["lo"] == 0 and m["hi"] is None else
                    f"an integer from {m['lo']} to {m['hi']}")
            what = m["why"] or (f"None ({m['none']}) or " if m["none"] else "") + base
            raise ConfigError(f"{f.name} must be {what}, got {value!r}")
