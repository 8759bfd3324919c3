"""Constrained decoding for ``response_format`` (edge0/constrain.py): generations sampled at
temperature 1 from random logits, through mlx-lm's own ``generate_step`` and through a
plain loop, parse as JSON and satisfy the schema; EOS stays masked until the document is
complete; every malformed ``response_format`` is a ConfigError naming its field."""

from __future__ import annotations

import json
import platform
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import edge0
from edge0.constrain import compile_response_format, parse_response_format
from edge0.errors import ConfigError, ConstraintError
from tests.syncs import count_syncs

V = 2048  # the demo tokenizer's vocabulary
WIDTH = V + 64  # a model whose logits have 64 padding rows past the vocabulary
EOS = 0
RAMP = 40.0  # the fake model's pull toward closing tokens grows by 1 every RAMP steps

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "status": {"type": "string", "enum": ["active", "inactive", "banned"]},
        "items": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
            "required": ["sku", "qty"], "additionalProperties": False}},
    },
    "required": ["name", "age", "status", "items"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER_SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(Path(edge0.__file__).parent / "data" / "demo_model")


@pytest.fixture(scope="module")
def closers(tokenizer) -> np.ndarray:
    """1.0 on tokens made only of ``"``, ``}``, ``]``, ``,``: the fake model's drift toward
    them makes random documents end within a few hundred tokens."""
    ind = np.zeros(WIDTH, dtype=np.float32)
    for i in range(1, V):
        text = tokenizer.decode([i])
        if text and set(text) <= set('"}],'):
            ind[i] = 1.0
    assert ind.sum() >= 4
    return ind


class RandomModel:
    """Stands in for a model in mlx-lm's ``generate_step``: logits are standard normal, plus
    a drift toward closing tokens, plus +10 on the padding rows (sampled at once if the
    mask let them through)."""

    layers: list = []

    def __init__(self, closers: np.ndarray):
        bias = np.zeros(WIDTH, dtype=np.float32)
        bias[V:] = 10.0
        self.bias, self.closers, self.calls = mx.array(bias), mx.array(closers), 0

    def __call__(self, inputs, cache=None):
        self.calls += 1
        return mx.random.normal((1, inputs.shape[1], WIDTH)) + self.bias + self.closers * (self.calls / RAMP)


def generate(tokenizer, closers, constraint, seed: int, max_tokens: int = 1200) -> tuple[list[int], bool]:
    """(tokens before EOS, whether EOS came) from mlx-lm's generate_step at temperature 1,
    a 20-token prompt prefilled in chunks of 4."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    prompt = mx.array(tokenizer.encode("def f(x):\n    return {'a': x, 'b': [1, 2, 3]}\n")[:20])
    out = []
    for tok, _ in generate_step(prompt, RandomModel(closers), max_tokens=max_tokens, sampler=make_sampler(1.0),
                                logits_processors=[constraint.processor()], prompt_cache=[], prefill_step_size=4):
        if tok == EOS:
            return out, True
        out.append(tok)
    return out, False


def check_order(doc) -> None:
    assert isinstance(doc, dict) and list(doc) == ["name", "age", "status", "items"], doc
    assert isinstance(doc["name"], str)
    assert type(doc["age"]) is int and doc["age"] >= 0
    assert doc["status"] in ("active", "inactive", "banned")
    assert isinstance(doc["items"], list) and len(doc["items"]) >= 1
    for item in doc["items"]:
        assert isinstance(item, dict) and sorted(item) == ["qty", "sku"], item
        assert isinstance(item["sku"], str) and type(item["qty"]) is int


@pytest.mark.parametrize("seed", range(4))
def test_json_object_generation_parses(tokenizer, closers, seed):
    constraint = compile_response_format({"type": "json_object"}, tokenizer)
    out, ended = generate(tokenizer, closers, constraint, seed)
    assert ended, "no EOS within the token budget"
    assert all(t < V for t in out), "a padding row was sampled"
    assert isinstance(json.loads(tokenizer.decode(out)), dict)


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_generation_validates(tokenizer, closers, seed):
    constraint = compile_response_format(SCHEMA_FORMAT, tokenizer)
    assert (constraint.kind, constraint.name) == ("json_schema", "order")
    out, ended = generate(tokenizer, closers, constraint, seed)
    assert ended, "no EOS within the token budget"
    check_order(json.loads(tokenizer.decode(out)))


def loop(tokenizer, closers, processor, seed: int, max_tokens: int = 1200, on_step=None) -> list[int]:
    """A plain decode loop with NumPy's random logits (thread-safe, unlike mx.random) and
    NumPy sampling at temperature 1; ``on_step(out, processed_logits)`` sees each step."""
    rng = np.random.default_rng(seed)
    tokens, out = mx.array([7, 8, 9]), []
    for step in range(max_tokens):
        logits = rng.standard_normal(WIDTH).astype(np.float32) + closers * (step / RAMP)
        processed = np.array(processor(tokens, mx.array(logits)[None]))[0]
        if on_step:
            on_step(out, processed)
        p = np.exp(processed - processed.max())
        tok = int(rng.choice(WIDTH, p=p / p.sum()))
        if tok == EOS:
            return out
        out.append(tok)
        tokens = mx.concatenate([tokens, mx.array([tok])])
    raise AssertionError("no EOS within the token budget")


def complete(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


@pytest.mark.parametrize("fmt", [{"type": "json_object"}, SCHEMA_FORMAT], ids=["json_object", "json_schema"])
def test_eos_is_masked_until_the_document_is_complete(tokenizer, closers, fmt):
    constraint = compile_response_format(fmt, tokenizer)
    seen = {"masked": 0, "allowed": 0}

    def on_step(out, processed):
        eos_allowed = bool(np.isfinite(processed[EOS]))
        assert eos_allowed == complete(tokenizer.decode(out)), tokenizer.decode(out)
        assert np.isneginf(processed[V:]).all()
        seen["allowed" if eos_allowed else "masked"] += 1

    for seed in range(2):
        loop(tokenizer, closers, constraint.processor(), seed, on_step=on_step)
    assert seen["masked"] > 2 * 5 and seen["allowed"] >= 2


def test_one_constraint_serves_generations_at_once(tokenizer, closers):
    constraint = compile_response_format(SCHEMA_FORMAT, tokenizer)
    results, errors = {}, []

    def run(seed):
        try:
            results[seed] = tokenizer.decode(loop(tokenizer, closers, constraint.processor(), seed))
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in (10, 11, 12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for text in results.values():
        check_order(json.loads(text))
    assert len(set(results.values())) == 3
    check_order(json.loads(tokenizer.decode(loop(tokenizer, closers, constraint.processor(), 10))))


def test_one_host_sync_per_token(tokenizer, closers):
    constraint = compile_response_format({"type": "json_object"}, tokenizer)
    processor, waits = constraint.processor(), []

    def counted(tokens, logits):
        with count_syncs() as c:
            out = processor(tokens, logits)
        waits.append(c.waiting())
        return out

    out = loop(tokenizer, closers, counted, seed=1)
    assert waits == [0] + [1] * len(out)  # the first call (after prefill) reads nothing back


def test_a_refused_token_and_a_reused_processor_raise(tokenizer):
    constraint = compile_response_format({"type": "json_object"}, tokenizer)
    logits = mx.zeros((1, V))
    processor = constraint.processor()
    processor(mx.array([5, 6]), logits)
    letter = tokenizer.encode("a")[0]
    with pytest.raises(ConstraintError, match="refused token"):
        processor(mx.array([5, 6, letter]), logits)  # a document must start with '{'
    processor = constraint.processor()
    processor(mx.array([5, 6, 7]), logits)
    brace = tokenizer.encode("{")[0]
    processor(mx.array([5, 6, 7, brace]), logits)
    assert processor.consumed == 1 and not processor.accepting
    with pytest.raises(ConstraintError, match="one generation"):
        processor(mx.array([1, 2]), logits)  # another generation's tokens


def test_text_and_no_format_give_no_constraint(tokenizer):
    assert compile_response_format(None, tokenizer) is None
    assert compile_response_format({"type": "text"}, tokenizer) is None
    assert parse_response_format({"type": "json_object"}) == ("json_object", {"type": "object"}, None)


def test_the_grammar_tokenizer_is_built_once_per_tokenizer(tokenizer):
    from edge0.constrain import _grammar_tokenizer

    assert _grammar_tokenizer(tokenizer) is _grammar_tokenizer(tokenizer)
    lltok, eos = _grammar_tokenizer(tokenizer)
    assert lltok.vocab_size == V and eos == [EOS]


BAD = [
    ("json", "response_format"),
    ({}, "response_format.type"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": ["json_object"]}, "response_format.type"),
    ({"type": "text", "json_schema": {}}, "response_format.json_schema"),
    ({"type": "json_object", "schema": {}}, "response_format.schema"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": "order"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "order"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "order", "schema": ["a"]}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": 7, "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "description": 5}},
     "response_format.json_schema.description"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}, "response_format.json_schema.extra"),
]
BAD_SCHEMAS = [
    {"type": "foo"},
    {"not": {"type": "string"}},  # a keyword the grammar engine does not implement
    {"type": "string", "pattern": "("},
    {"$ref": "#/$defs/missing"},
    {"type": "number", "maximum": float("nan")},
    {"type": "object", "default": object()},
    {"allOf": [{"type": "string"}, {"type": "integer"}]},
]


@pytest.mark.parametrize("fmt,field", BAD, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD)])
def test_a_malformed_shape_is_a_config_error_naming_the_field(tokenizer, fmt, field):
    with pytest.raises(ConfigError) as err:
        compile_response_format(fmt, tokenizer)
    assert str(err.value).startswith(field + ":"), str(err.value)


@pytest.mark.parametrize("schema", BAD_SCHEMAS, ids=range(len(BAD_SCHEMAS)))
def test_an_invalid_or_unsupported_schema_is_a_config_error(tokenizer, schema):
    with pytest.raises(ConfigError) as err:
        compile_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, tokenizer)
    assert str(err.value).startswith("response_format.json_schema.schema: "), str(err.value)


def test_a_refused_format_keeps_no_matcher(tokenizer, monkeypatch):
    """The refusal's traceback holds no frame that holds the grammar engine's matcher: a
    caller keeping the error in a reference cycle (the server's worker-thread future) would
    keep the matcher, 180 MB for a heavy pattern, until a full garbage collection."""
    import llguidance

    import edge0.constrain as C

    monkeypatch.setattr(C, "PROBE_FIRST_S", -1.0)  # every first mask is too slow: refused at once
    with pytest.raises(ConfigError, match="too expensive to enforce") as err:
        compile_response_format(SCHEMA_FORMAT, tokenizer)
    held, e = [], err.value
    while e is not None:
        tb = e.__traceback__
        while tb is not None:
            held += [(tb.tb_frame.f_code.co_name, k) for k, v in tb.tb_frame.f_locals.items()
                     if isinstance(v, llguidance.LLMatcher)]
            tb = tb.tb_next
        e = e.__context__ or e.__cause__
    assert held == []


REFUSALS = 5  # about 0.8 s each: a first mask runs to its end before its time is checked
REFUSE_IN_WORKER_THREADS = """
import sys
from pathlib import Path

import anyio
import anyio.to_thread
from mlx_lm.utils import load_tokenizer

import edge0
import edge0.constrain
from edge0.constrain import ConstraintCache
from edge0.errors import ConfigError

edge0.constrain.PROBE_FIRST_S = 0.1  # each first mask takes 0.8 s here: refused on a faster machine too


def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


class Refused(Exception):
    pass


cache = ConstraintCache(load_tokenizer(Path(edge0.__file__).parent / "data" / "demo_model"))
cache.get({"type": "json_object"})  # the library loaded and the grammar tokenizer built before the start


def check(fmt):  # as the server does, in a worker thread: the refusal becomes its own error
    try:
        cache.get(fmt)
    except ConfigError as e:
        raise Refused(str(e)) from None


async def main():
    start = rss_mib()
    for i in range(int(sys.argv[1])):
        pattern = "^(a{%d}){1000}$" % (1000 + i)  # distinct: no cache hit
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": pattern}}}
        try:
            await anyio.to_thread.run_sync(check, fmt)
        except Refused as e:
            assert "too expensive to enforce" in str(e), str(e)
        else:
            raise AssertionError("accepted: " + pattern)
    print(rss_mib() - start)


anyio.run(main)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="reads /proc; the heap is handed back through glibc")
def test_refused_formats_keep_no_memory():
    """Distinct schemas too expensive to enforce, refused in worker threads as the server
    refuses them: the process ends within 64 MiB of its start. Each refusal kept 180 MB
    (the grammar engine's matcher, alive through the error, then the pages of a worker
    thread's heap arena): 1.2 GB more after ten; with the matcher dropped but the heap not
    trimmed, 105 MB after five (0-20 MB with both)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", REFUSE_IN_WORKER_THREADS, str(REFUSALS)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    grown = float(r.stdout.split()[-1])
    assert grown <= 64, f"RSS grew {grown:.0f} MiB over {REFUSALS} refused formats"


def test_whitespace_runs_are_bounded(tokenizer):
    """Flexible whitespace: up to MAX_WHITESPACE_RUN whitespace characters in a row are
    allowed, one more is not (a model cannot loop on whitespace inside an open document).
    Compact (the default): none at all."""
    from edge0.constrain import MAX_WHITESPACE_RUN

    (space,) = tokenizer.encode(" ", add_special_tokens=False)
    (brace,) = tokenizer.encode("{", add_special_tokens=False)
    width = tokenizer.vocab_size
    prompt = [5]
    for whitespace, run in (("flexible", MAX_WHITESPACE_RUN), ("compact", 0)):
        proc = compile_response_format({"type": "json_object"}, tokenizer, whitespace).processor()
        proc(mx.array(prompt), mx.zeros((1, width)))
        tokens = prompt + [brace]
        for n in range(run + 1):
            allowed = np.array(proc(mx.array(tokens), mx.zeros((1, width))))[0] > -np.inf
            assert allowed[space] == (n < run), (whitespace, n)
            tokens.append(space)
    default = compile_response_format({"type": "json_object"}, tokenizer).processor()
    default(mx.array(prompt), mx.zeros((1, width)))
    assert not (np.array(default(mx.array(prompt + [brace]), mx.zeros((1, width))))[0] > -np.inf)[space]


def test_objects_that_name_their_properties_are_closed_to_others():
    """Under a json_schema an object that lists its properties and says nothing of others
    takes no others (a model once added keys until max_tokens); what the schema says
    explicitly, and allOf's branches (which intersect), are left alone; keywords are told
    from property names."""
    from edge0.constrain import closed_objects

    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},  # a property named so
        "open": {"type": "object", "properties": {"b": {}}, "additionalProperties": True},
        "list": {"type": "array", "items": {"type": "object", "properties": {"c": {}}}},
        "either": {"anyOf": [{"type": "object", "properties": {"d": {}}}, {"type": "null"}]},
        "both": {"allOf": [{"type": "object", "properties": {"e": {}}}, {"properties": {"f": {}}}]},
        "free": {"type": "object"},
        "conditional": {"type": "object", "properties": {"k": {}}, "if": {"properties": {"k": {"const": 1}}},
                        "then": {"properties": {"v": {}}}},
        "mixed": {"type": "object", "properties": {"k": {}}, "anyOf": [{"properties": {"x": {}}}]}},
        "$defs": {"node": {"type": "object", "properties": {"g": {"$ref": "#/$defs/node"}}}}}
    out = closed_objects(json.loads(json.dumps(schema)))
    p = out["properties"]
    assert out["additionalProperties"] is False
    assert p["properties"]["additionalProperties"] is False and "additionalProperties" not in p["properties"]["properties"]
    assert p["open"]["additionalProperties"] is True
    assert p["list"]["items"]["additionalProperties"] is False
    assert p["either"]["anyOf"][0]["additionalProperties"] is False
    assert all("additionalProperties" not in b for b in p["both"]["allOf"])
    assert "additionalProperties" not in p["free"]  # names no properties: any
    assert out["$defs"]["node"]["additionalProperties"] is False
    cond = p["conditional"]  # then may add "v": neither it nor its condition is closed
    assert all("additionalProperties" not in n for n in (cond, cond["if"], cond["then"]))
    assert "additionalProperties" not in p["mixed"] and "additionalProperties" not in p["mixed"]["anyOf"][0]
