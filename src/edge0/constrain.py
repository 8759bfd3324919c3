"""Constrained decoding for OpenAI's ``response_format``: a logits mask per token.

``compile_response_format(response_format, tokenizer)`` checks the request's
``response_format`` and compiles it into a ``Constraint`` (``None`` for ``{"type": "text"}``
or no format):

- ``{"type": "json_object"}``: any JSON object (the schema ``{"type": "object"}``);
- ``{"type": "json_schema", "json_schema": {"name": .., "schema": {..}, "strict": ..}}``:
  a document valid against ``schema``.

Every malformed shape, unknown field, unsupported or invalid schema raises ``ConfigError``
naming the field (``response_format.json_schema.schema: ...``), so a server answers 400
before any generation starts (``parse_response_format`` checks the shape alone, without
the grammar library). ``name`` (optional here), ``description`` and ``strict`` are checked
but change nothing: the schema is enforced either way. Whitespace between tokens: none
(compact JSON, the default), or JSON's at most ``MAX_WHITESPACE_RUN`` characters in a row
(``whitespace="flexible"``: a model cannot loop on it).
``Constraint.processor()`` makes a fresh per-generation logits processor with mlx-lm's signature ``processor(tokens, logits) -> logits``: each call feeds
the grammar the token sampled since the last call, computes the set of tokens the grammar
allows next and sets every other logit (padding rows past the tokenizer's vocabulary
included) to -inf; EOS is allowed only once the document is complete. One Constraint may
serve any number of generations, one after the other or at once: each processor holds its
own matcher state.

The grammar engine is llguidance (chosen by measurement among llguidance, xgrammar and
outlines-core: ``tools/constrained_cost.py``), imported only when a format is compiled.
The processor makes one host sync per token (reading the sampled token back, which the
mask depends on) and starts the model's step on the device before computing the mask on
the host, so the two overlap.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
import weakref
from collections.abc import Mapping

from edge0.errors import ConfigError, ConstraintError, FormatTooCostlyError
from edge0.heap import allocated_bytes, trim_heap

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
JSON_OBJECT_SCHEMA = {"type": "object"}
_JSON_SCHEMA_FIELDS = ("name", "description", "schema", "strict")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# whitespace between JSON tokens (EngineConfig.json_whitespace): "compact", none (a model
# spends no token on it: a schema of a name and an age once took 125 tokens, in runs of 39
# spaces, when any was allowed); "flexible", any mix of JSON's four, at most 40 in a row
# (room for a newline and the indentation of a pretty-printed document 19 levels deep), so
# a model cannot loop on whitespace for ever inside a document the mask keeps open
MAX_WHITESPACE_RUN = 40
JSON_OPTIONS = {
    "compact": {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
    "flexible": {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,%d}" % MAX_WHITESPACE_RUN},
}

_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401  (the mask-into-array helpers)
    except ImportError:
        raise ConfigError("response_format: constrained decoding needs the 'llguidance' package "
                          "(pip install llguidance)") from None
    return llguidance


def _one_line(error: str) -> str:
    """An llguidance error on one line, without the parser-state dump that may follow it."""
    return " ".join(error.split("<state>")[0].split())[:300] or "(no message)"


def _unknown_fields(obj: Mapping, allowed, where: str) -> None:
    extra = sorted(str(k) for k in obj if k not in allowed)
    if extra:
        raise ConfigError(f"{where}.{extra[0]}: unknown field (allowed: {', '.join(sorted(allowed))})")


def parse_response_format(response_format) -> tuple[str, dict, str | None] | None:
    """Check OpenAI's ``response_format`` shape: ``None`` for no constraint (absent, or
    ``{"type": "text"}``), else ``(kind, schema, name)`` with ``kind`` ``json_object`` or
    ``json_schema``. Raises ``ConfigError`` naming the offending field. Needs no grammar
    library."""
    if response_format is None:
        return None
    where = "response_format"
    if not isinstance(response_format, Mapping):
        raise ConfigError(f"{where}: must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind is None:
        raise ConfigError(f"{where}.type: required (one of {', '.join(RESPONSE_FORMAT_TYPES)})")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ConfigError(f"{where}.type: must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {kind!r}")
    if kind != "json_schema":
        _unknown_fields(response_format, ("type",), where)
        return None if kind == "text" else ("json_object", dict(JSON_OBJECT_SCHEMA), None)
    _unknown_fields(response_format, ("type", "json_schema"), where)
    spec = response_format.get("json_schema")
    where += ".json_schema"
    if spec is None:
        raise ConfigError(f"{where}: required when type is 'json_schema'")
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{where}: must be an object, got {type(spec).__name__}")
    _unknown_fields(spec, _JSON_SCHEMA_FIELDS, where)
    name = spec.get("name")
    if name is not None and not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise ConfigError(f"{where}.name: must be 1 to 64 letters, digits, '_' or '-', got {name!r}")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise ConfigError(f"{where}.description: must be a string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ConfigError(f"{where}.strict: must be true or false, got {spec['strict']!r}")
    schema = spec.get("schema")
    if schema is None:
        raise ConfigError(f"{where}.schema: required")
    if not isinstance(schema, Mapping):
        raise ConfigError(f"{where}.schema: must be a JSON Schema object, got {type(schema).__name__}")
    return "json_schema", dict(schema), name


MAX_SCHEMA_BYTES = 64 * 1024  # of the schema's JSON text (a 2 MB const took 1.8 s to its first mask)
# Compiling a format walks its first steps, off the compute thread: the first mask and
# PROBE_STEPS more along two paths (the lowest and the highest token id allowed), each
# within these bounds, or the format is refused before any generation starts
PROBE_STEPS = 4
PROBE_FIRST_S = 0.5
PROBE_STEP_S = 0.05
# While generating, one token's grammar work (advance and mask) for one row, which the whole
# batch waits for: a row over it ends with FormatTooCostlyError (0.2-0.3 ms is usual)
MASK_STEP_S = 0.25


def _limits():
    """llguidance's resource limits for every matcher: its defaults, but no parser-state
    dumps in errors (they may hold the schema)."""
    return _llguidance().LLParserLimits(verbose_errors=False)


def _schema_text(schema: dict, where: str) -> str:
    try:
        text = json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise ConfigError(f"{where}: not JSON: {e}") from None
    if len(text.encode("utf-8")) > MAX_SCHEMA_BYTES:
        raise ConfigError(f"{where}: the schema is {len(text.encode('utf-8'))} bytes of JSON, more than the "
                          f"{MAX_SCHEMA_BYTES} a response_format may take")
    return text


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_SCHEMA_ONE = ("additionalProperties", "items", "unevaluatedItems")
_BRANCHES = ("anyOf", "oneOf", "allOf")
_COMBINES = _BRANCHES + ("if", "then", "else", "not", "dependentSchemas", "$ref")  # may add or test properties


def closed_objects(schema):
    """``schema`` with every object that names its ``properties`` and says nothing of
    others closed to them (``additionalProperties: false``), as OpenAI's strict mode
    requires and other servers' grammar engines assume: the model writes the fields the
    schema names and then closes the object, instead of adding keys until ``max_tokens``.
    Left as they are: an object that says ``additionalProperties`` or
    ``unevaluatedProperties``; one whose own keywords combine it with other schemas (a
    sibling ``anyOf``, ``oneOf``, ``allOf``, ``if``/``then``/``else``, ``not``,
    ``dependentSchemas`` or ``$ref``, which may add properties); a branch of such a
    combination whose parent names properties (the two intersect); and anything inside
    ``if``/``then``/``else``, ``not``, ``dependentSchemas``, ``contains`` and
    ``propertyNames`` (conditions, not shapes). Changes ``schema`` in place and returns it."""
    todo = [(schema, False)]
    while todo:
        node, intersects = todo.pop()
        if not isinstance(node, dict):
            continue
        if (isinstance(node.get("properties"), dict) and not intersects
                and not any(k in node for k in ("additionalProperties", "unevaluatedProperties", *_COMBINES))):
            node["additionalProperties"] = False
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                todo.extend((v, False) for v in node[key].values())
        for key in _SCHEMA_ONE:
            if isinstance(node.get(key), dict):
                todo.append((node[key], False))
        if isinstance(node.get("prefixItems"), list):
            todo.extend((v, False) for v in node["prefixItems"])
        if isinstance(node.get("items"), list):
            todo.extend((v, False) for v in node["items"])
        named = isinstance(node.get("properties"), dict)
        for key in _BRANCHES:
            if isinstance(node.get(key), list):
                todo.extend((v, named or key == "allOf") for v in node[key])
    return schema


def _explain(error: str) -> str:
    """llguidance's error, on one line, with what it means for the schema."""
    line = _one_line(error)
    if "NoExtensionBias" in line:
        return ("the schema admits no JSON value at all (e.g. a $ref that only refers to itself, or an empty "
                f"anyOf) [{line}]")
    if "too many expressions" in line or "LexerTooComplex" in line:
        return f"a pattern, const or enum too large for the grammar engine to enforce [{line}]"
    m = re.search(r"row has (\d+) items; max is (\d+)", line)
    if m:
        return (f"{m.group(1)} alternatives (anyOf, oneOf or enum branches) at one point, more than the "
                f"{m.group(2)} the grammar engine takes [{line}]")
    return line


def _grammar_tokenizer(tokenizer):
    """(llguidance tokenizer, EOS ids) for mlx-lm's TokenizerWrapper (or a Hugging Face fast
    tokenizer); built once per tokenizer object (about a second for a 150k vocabulary)."""
    with _tokenizers_lock:
        try:
            cached = _tokenizers.get(tokenizer)
        except TypeError:  # not weak-referenceable: no cache
            cached = None
        if cached is not None:
            return cached
        ll = _llguidance()
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise ConfigError("response_format: constrained decoding needs a fast (tokenizers) tokenizer; "
                              f"this model's is {type(hf).__name__}")
        eos = getattr(tokenizer, "eos_token_ids", None) or [getattr(hf, "eos_token_id", None)]
        eos = sorted(int(t) for t in eos if t is not None)
        if not eos:
            raise ConfigError("response_format: the model's tokenizer has no EOS token to end a document with")
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        try:
            built = ll.LLTokenizer(backend.to_str(), eos_token=eos), eos
        except Exception as e:  # noqa: BLE001  (the library's own errors, whatever their type)
            raise ConfigError(f"response_format: the model's tokenizer is not usable for constrained decoding: "
                              f"{type(e).__name__}: {str(e)[:300]}") from None
        try:
            _tokenizers[tokenizer] = built
        except TypeError:
            pass
        return built


def compile_response_format(response_format, tokenizer, whitespace: str = "compact") -> Constraint | None:
    """A ``Constraint`` for OpenAI's ``response_format`` (``None`` for text or none) over
    ``tokenizer`` (mlx-lm's TokenizerWrapper), writing JSON with ``whitespace``
    (``JSON_OPTIONS``). Raises ``ConfigError`` naming the field for a malformed shape or a
    schema the grammar engine rejects or does not support."""
    parsed = parse_response_format(response_format)
    if parsed is None:
        return None
    kind, schema, name = parsed
    where = "response_format.json_schema.schema" if kind == "json_schema" else "response_format"
    text = _schema_text(schema, where)
    if kind == "json_schema":
        text = json.dumps(closed_objects(json.loads(text)))  # (a copy: the request's schema is not changed)
    ll = _llguidance()
    try:
        grammar = ll.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS[whitespace])
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where}: {e}") from None
    return _compiled(ll, tokenizer, grammar, kind, schema, name, text, where)


def compile_grammar(lark: str, tokenizer) -> Constraint:
    """A ``Constraint`` for llguidance's Lark syntax (``SamplingParams.grammar``), bounded as a
    ``response_format`` is; ``ConfigError("grammar: ...")`` for one the library refuses."""
    where = "grammar"
    if not isinstance(lark, str) or len(lark.encode("utf-8")) > MAX_SCHEMA_BYTES:
        raise ConfigError(f"{where}: must be a Lark grammar of at most {MAX_SCHEMA_BYTES} bytes")
    ll = _llguidance()
    try:
        grammar = ll.LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where}: {_one_line(str(e))}") from None
    return _compiled(ll, tokenizer, grammar, "grammar", {}, None, lark, where)


def _compiled(ll, tokenizer, grammar: str, kind: str, schema: dict, name, text: str, where: str) -> Constraint:
    lltok, eos = _grammar_tokenizer(tokenizer)
    try:
        return _build(ll, lltok, eos, grammar, kind, schema, name, text, where)
    except ConfigError as e:
        # A refused format keeps nothing. Its error's traceback holds the frames of _build
        # and _probe, whose locals are the grammar engine's matcher and its copies (180 MB
        # for one heavy pattern): a caller holding the error in a reference cycle (as the
        # server's worker-thread future does) kept them until a full garbage collection,
        # and the server grew 180 MB a refusal. Dropped here...
        e.__traceback__ = None
        # ...and the pages they were freed to handed back: glibc keeps them in the arena of
        # the thread that compiled (ten distinct refusals still held 150 MB more)
        trim_heap()
        raise


def _build(ll, lltok, eos, grammar: str, kind: str, schema: dict, name, text: str, where: str) -> Constraint:
    before = allocated_bytes()
    matcher = ll.LLMatcher(lltok, grammar, log_level=0, limits=_limits())
    if matcher.is_error():
        raise ConfigError(f"{where}: {_explain(matcher.get_error())}")
    _probe(matcher, lltok.vocab_size, where)
    constraint = Constraint(kind, schema, name, matcher, lltok.vocab_size, tuple(eos))
    # what it holds, as the heap's growth while it was built (the grammar engine reports
    # no size of its own; another thread's allocations meanwhile can only inflate it)
    constraint.nbytes = max(len(text), allocated_bytes() - before)
    return constraint


def _probe(matcher, vocab_size: int, where: str) -> None:
    """The format's first steps, walked on copies of ``matcher``: parts of the grammar are
    built lazily (their errors show only there), and a format whose masks are too slow to
    compute would stall every row of the batch it joins. ``ConfigError`` for either."""
    import numpy as np
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    bitmask = allocate_token_bitmask(1, vocab_size)
    for pick in (0, -1):  # the lowest and the highest token id allowed at each step
        m = matcher.deep_copy()
        for step in range(PROBE_STEPS + 1):
            t0 = time.perf_counter()
            fill_next_token_bitmask(m, bitmask, 0)
            seconds = time.perf_counter() - t0
            if m.is_error():
                raise ConfigError(f"{where}: {_explain(m.get_error())}")
            bound = PROBE_FIRST_S if step == 0 else PROBE_STEP_S
            if seconds > bound:
                raise ConfigError(f"{where}: the schema is too expensive to enforce: computing the "
                                  f"{'first' if step == 0 else f'step {step}'} token mask took {seconds:.2f} s "
                                  f"(at most {bound:g} s)")
            allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_size])
            if len(allowed) == 0 or m.is_stopped():
                break
            if not m.consume_token(int(allowed[pick])):
                raise ConfigError(f"{where}: {_explain(m.get_error())}")


class Constraint:
    """A compiled ``response_format``: ``kind`` (``json_object`` / ``json_schema``),
    ``schema``, ``name``, ``vocab_size`` (the tokenizer ids its masks cover) and
    ``eos_token_ids``. ``processor()`` gives each generation its own logits processor."""

    def __init__(self, kind: str, schema: dict, name: str | None, matcher, vocab_size: int, eos_token_ids):
        self.kind, self.schema, self.name = kind, schema, name
        self.nbytes = 0  # the memory it holds, as estimated when compiled
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(eos_token_ids)
        self._template = matcher
        self._lock = threading.Lock()

    def processor(self) -> ConstraintProcessor:
        """A fresh logits processor for one generation (mlx-lm's ``logits_processors``
        signature); put it last in the list so that nothing changes the logits after it."""
        with self._lock:
            matcher = self._template.deep_copy()
        return ConstraintProcessor(matcher, self.vocab_size)

    def __repr__(self) -> str:
        return f"Constraint({self.kind}, name={self.name!r}, vocab_size={self.vocab_size})"


class ConstraintProcessor:
    """One generation's logits processor: ``processor(tokens, logits) -> logits``.

    ``tokens`` is every token so far, the prompt included (mlx-lm's convention; a prompt
    served from a cache may be passed shortened: only its length at the first call
    matters); ``logits`` is ``[1, V]`` or ``[V]``, ``V`` the model's width (which may exceed
    the tokenizer's vocabulary: rows past it are masked). The first call comes after
    prefill, before any generated token: it records the prompt length. Each later call feeds
    the grammar the tokens appended since (normally one) and masks the logits for the next.
    Not thread-safe: one generation, one thread."""

    def __init__(self, matcher, vocab_size: int):
        import numpy as np
        from llguidance.numpy import fill_next_token_bitmask

        from edge0.backend import core as B

        self._np, self._B, self._fill = np, B, fill_next_token_bitmask
        self._m = matcher
        self._n_vocab = vocab_size
        self._prompt_len: int | None = None
        self._consumed = 0
        self._bitmask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)
        self._allowed = None

    @property
    def consumed(self) -> int:
        """Generated tokens fed to the grammar so far."""
        return self._consumed

    @property
    def accepting(self) -> bool:
        """The text so far is a complete document (EOS is allowed)."""
        return self._m.is_accepting()

    @property
    def done(self) -> bool:
        """The document cannot grow: only EOS is allowed next."""
        return self._m.is_stopped()

    def __call__(self, tokens, logits):
        B = self._B
        t0 = time.perf_counter()
        self._advance(tokens, B)
        B.async_eval(logits)  # the model's step runs on the device while the mask is computed
        allowed = B.array(self._mask(logits.shape[-1]))
        spent = time.perf_counter() - t0
        if spent > MASK_STEP_S:
            raise FormatTooCostlyError(f"response_format: the schema is too expensive to enforce: the token mask "
                                       f"after {self._consumed} generated tokens took {spent:.2f} s (at most "
                                       f"{MASK_STEP_S:g} s a token)")
        return B.where(allowed, logits, B.array(float("-inf"), dtype=logits.dtype))

    def _advance(self, tokens, B) -> None:
        if isinstance(tokens, B.Array):
            if tokens.ndim == 2 and tokens.shape[0] == 1:
                tokens = tokens[0]
            if tokens.ndim != 1:
                raise ConstraintError(f"constrained decoding: tokens must be one sequence, got shape {tokens.shape}")
        n = len(tokens)
        if self._prompt_len is None:
            self._prompt_len = n
            return
        new = n - self._prompt_len - self._consumed
        if new < 0:
            raise ConstraintError(f"constrained decoding: {n} tokens after a {self._prompt_len}-token prompt and "
                                  f"{self._consumed} generated: a processor serves one generation (make one per "
                                  "generation with Constraint.processor())")
        if new == 0:
            return
        tail = tokens[n - new:]
        ids = B.to_host(tail).tolist() if isinstance(tail, B.Array) else [int(t) for t in tail]
        for tok in ids:
            if not self._m.consume_token(int(tok)):
                raise ConstraintError(f"constrained decoding: the grammar refused token {tok} after "
                                      f"{self._consumed} generated tokens: {_one_line(self._m.get_error())}")
            self._consumed += 1

    def _mask(self, width: int):
        """Boolean [width]: the tokens the grammar allows next."""
        np = self._np
        self._fill(self._m, self._bitmask, 0)
        if self._m.is_error():
            raise ConstraintError(f"constrained decoding: {_explain(self._m.get_error())}")
        if self._allowed is None or self._allowed.shape[0] != width:
            self._allowed = np.zeros(width, dtype=bool)  # rows past the vocabulary stay False
        k = min(width, self._n_vocab)
        bits = self._bitmask.astype("<i4", copy=False).view(np.uint8)  # token i is bit i % 8 of byte i // 8
        self._allowed[:k] = np.unpackbits(bits, count=k, bitorder="little")
        if not self._allowed[:k].any():
            raise ConstraintError(f"constrained decoding: the grammar allows no token of the model's {width} "
                                  f"after {self._consumed} generated tokens")
        return self._allowed


class ConstraintCache:
    """Compiled ``response_format``s of one tokenizer, the most recently used kept within
    ``size`` entries and ``max_bytes`` of the memory they hold (each entry's estimate,
    ``Constraint.nbytes``): a generation asking for one that an earlier one asked for does
    not compile it again, and distinct heavy schemas cannot grow the process without bound
    (six of them once took it from 129 MB to 1.3 GB). One larger than ``max_bytes`` is used
    by its generation and not kept."""

    def __init__(self, tokenizer, size: int = 32, max_bytes: int = 64 * 2**20, whitespace: str = "compact"):
        self.tokenizer, self.size, self.max_bytes, self.whitespace = tokenizer, size, max_bytes, whitespace
        self._lock = threading.Lock()
        self._entries: dict[str, Constraint | None] = {}

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(c.nbytes for c in self._entries.values() if c is not None)

    def get(self, response_format, grammar: str | None = None) -> Constraint | None:
        """The compiled ``response_format``, or ``grammar`` (llguidance's Lark) when given."""
        if response_format is None and grammar is None:
            return None
        key = json.dumps([response_format, grammar], sort_keys=True)
        with self._lock:
            hit = self._entries.pop(key, _MISSING)
        if hit is _MISSING:
            hit = compile_grammar(grammar, self.tokenizer) if grammar is not None else \
                compile_response_format(response_format, self.tokenizer, self.whitespace)
        with self._lock:
            if hit is None or hit.nbytes <= self.max_bytes:
                self._entries[key] = hit
            while len(self._entries) > self.size or sum(
                    c.nbytes for c in self._entries.values() if c is not None) > self.max_bytes:
                self._entries.pop(next(iter(self._entries)))
        return hit


_MISSING = object()
