"""A prompt cache made by mlx-lm (``mlx_lm.cache_prompt``'s file, ``save_prompt_cache``)
continued by Edge0: ``Engine.stream(prompt, prompt_cache=...)`` and ``edge0 generate
--prompt-cache-file``, as mlx-lm's ``stream_generate(prompt_cache=)`` and
``mlx_lm.generate --prompt-cache-file`` do it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from mlx_lm.utils import load_model, load_tokenizer

import edge0
from edge0 import ConfigError, Engine, EngineConfig
from edge0.backend import nn as bnn
from edge0.cli import PACKAGED_DEMO
from tests.ckpt_tools import peak_rss, rewrite_header

PREFIX = "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n"
SUFFIX = "        lines = f.read()\n        return"


def _cache_file(ref, ids: list[int], path, model: str) -> str:
    """What mlx_lm.cache_prompt writes: the prefix's cache and the model it was made with."""
    cache = make_prompt_cache(ref)
    ref(mx.array(ids)[None], cache=cache)
    mx.eval([c.state for c in cache])
    save_prompt_cache(str(path), cache, {"model": model, "tokenizer_config": "{}"})
    return str(path)


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("qwen3_moe")


@pytest.fixture(scope="module")
def reference(tiny):
    model, _ = load_model(tiny)
    bnn.cast_model(model, mx.float32)
    return model, load_tokenizer(tiny)


def test_a_cache_file_continues_as_in_mlx_lm_on_every_path(tiny, reference, tmp_path):
    """Edge0's greedy tokens and log-probabilities after an mlx-lm cache equal mlx-lm's
    ``stream_generate`` with the same cache, on the exact, hot and whole-layer paths and
    batched with another generation; the tokens equal the whole prompt's; the cache the
    caller gave is extended in place, as mlx-lm's is."""
    ref, tok = reference
    prefix, suffix = tok.encode(PREFIX), tok.encode(SUFFIX, add_special_tokens=False)
    path = _cache_file(ref, prefix, tmp_path / "c.safetensors", str(tiny))
    out = list(stream_generate(ref, tok, mx.array(suffix), max_tokens=16, prompt_cache=load_prompt_cache(path)))
    tokens, logprobs = [r.token for r in out], [r.logprobs[r.token].item() for r in out]
    for decode in ("exact", "hot", "whole_layer"):
        with Engine(tiny, EngineConfig(kernels="mlx", decode_path=decode, prefill_path=decode)) as e:
            cache = edge0.load_prompt_cache(path)
            events = list(e.stream(suffix, prompt_cache=cache, max_tokens=16, logprobs=True))
            assert [ev.token for ev in events] == tokens, decode
            assert max(abs(ev.logprob - lp) for ev, lp in zip(events, logprobs)) < 1e-5, decode
            assert cache[0].offset == len(prefix) + len(suffix) + 15  # extended in place (the last token is not fed)
            assert events[-1].stats.cached_tokens == len(prefix)
            assert events[-1].stats.prompt_tokens == len(prefix) + len(suffix)
            whole = [ev.token for ev in e.stream(prefix + suffix, max_tokens=16)]
            assert whole == tokens, decode

    async def both(e):
        async def one(ids, **kw):
            return [ev.token async for ev in e.generate(ids, max_tokens=16, **kw) if ev is not None]
        return await asyncio.gather(one(suffix, prompt_cache=bnn.load_cache_file(path)[0]), one(prefix))

    with Engine(tiny, EngineConfig(kernels="mlx", max_batch=4)) as e:
        alone = [ev.token for ev in e.stream(prefix, max_tokens=16)]
        got, other = asyncio.run(both(e))
    assert got == tokens and other == alone


def test_the_command_line_continues_a_cache_file_as_mlx_lm_generate_does(tmp_path):
    """``mlx_lm.cache_prompt`` then ``edge0 generate --prompt-cache-file`` (the model taken
    from the file) prints what ``mlx_lm.generate --prompt-cache-file`` prints, on the demo
    with its adapter in the checkpoint's dtype; without the cache the answer differs."""
    demo, path = str(PACKAGED_DEMO), str(tmp_path / "c.safetensors")
    adapter = ["--adapter-path", str(PACKAGED_DEMO / "adapter")]
    subprocess.run([sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", demo, *adapter, "--prompt", PREFIX,
                    "--prompt-cache-file", path], check=True, capture_output=True)
    common = ["--prompt", SUFFIX, "--max-tokens", "24", "--verbose", "false"]
    theirs = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--model", demo, *adapter, *common,
                             "--prompt-cache-file", path], check=True, capture_output=True, text=True).stdout
    ours_flags = ["--kernels", "mlx", "--compute-dtype", "bfloat16", "--prerouter", "off"]
    ours = subprocess.run([sys.executable, "-m", "edge0", "generate", *common, "--prompt-cache-file", path,
                           *ours_flags], check=True, capture_output=True, text=True).stdout
    assert ours == theirs and len(ours) > 10
    without = subprocess.run([sys.executable, "-m", "edge0", "generate", "--model", demo, *common, *ours_flags],
                             check=True, capture_output=True, text=True).stdout
    assert without != ours


def test_after_a_cache_the_prompt_is_the_chat_templates_text_from_its_message_on(tiny):
    """As mlx_lm.generate cuts it: the template rendered with the message's content as a
    marker, the text from the marker's place on; without a template, no special tokens."""
    tok = load_tokenizer(tiny)
    assert tok.has_chat_template
    messages = [{"role": "user", "content": "now count the lines"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    marked = tok.apply_chat_template([{"role": "user", "content": "<query>"}], tokenize=False,
                                     add_generation_prompt=True)
    want = tok.encode(text[marked.index("<query>"):], add_special_tokens=False)
    with Engine(tiny, EngineConfig()) as e:
        assert e.prompt_ids("now count the lines", after_cache=True) == want
        assert e.prompt_ids("now count the lines") != want  # the template's head is not written again
        assert e.prompt_ids("x y", chat_template=False, after_cache=True) == tok.encode("x y", add_special_tokens=False)


def test_the_demo_continues_a_cache_file_with_its_heads_and_adapter(tmp_path):
    """On the demo's default staged path (token heads, select routing) with its shipped
    adapter, a cache of the prefix made with the adapter gives the whole prompt's text
    (the suffix has at least three tokens, so the heads observe what a whole prefill shows
    them)."""
    from mlx_lm.tuner.utils import load_adapters

    ref, _ = load_model(PACKAGED_DEMO)
    load_adapters(ref, str(PACKAGED_DEMO / "adapter"))
    bnn.cast_model(ref, mx.float32)
    with Engine(PACKAGED_DEMO, EngineConfig(kernels="mlx")) as e:
        prefix, suffix = e.encode(PREFIX), e.tokenizer.encode(SUFFIX, add_special_tokens=False)
        path = _cache_file(ref, prefix, tmp_path / "demo.safetensors", str(PACKAGED_DEMO))
        text, stats = e.generate_text(suffix, prompt_cache=bnn.load_cache_file(path)[0], max_tokens=24)
        whole, _ = e.generate_text(prefix + suffix, max_tokens=24)
        assert stats.heads.startswith("prerouter") and stats.adapter.startswith("adapter")
        assert text == whole and len(text) > 10
        bare, _ = e.generate_text(suffix, max_tokens=24)
        assert bare != text


def test_a_cache_that_does_not_fit_is_refused_naming_why(tiny, tiny_model_factory, reference, tmp_path):
    ref, tok = reference
    path = _cache_file(ref, tok.encode(PREFIX), tmp_path / "c.safetensors", str(tiny))
    other = tiny_model_factory("mixtral", layers=3)
    with Engine(other, EngineConfig()) as e:
        with pytest.raises(ConfigError, match="holds 2 layers; this model has 3|holds .* layers; this model has"):
            e.generate_text([1, 2, 3], prompt_cache=bnn.load_cache_file(path)[0], max_tokens=2)
        assert e.generate_text([1, 2, 3], max_tokens=2)[0] is not None  # still serves
    with Engine(tiny, EngineConfig(kv_bits=4, kv_group_size=32)) as e:
        cache = bnn.load_cache_file(path)[0]
        cache = [c.to_quantized(group_size=32, bits=8) for c in cache]
        with pytest.raises(ConfigError, match="do not match the prompt cache's quantization \\(8 bits"):
            e.generate_text([1, 2, 3], prompt_cache=cache, max_tokens=2)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a cache")
    with pytest.raises(ConfigError, match="garbage.safetensors is not an mlx-lm prompt cache"):
        bnn.load_cache_file(garbage)
    with pytest.raises(ConfigError, match="no such file"):
        bnn.load_cache_file(tmp_path / "missing.safetensors")


def test_the_command_line_refuses_a_cache_made_with_another_model(tiny, tiny_model_factory, reference, tmp_path):
    ref, tok = reference
    path = _cache_file(ref, tok.encode(PREFIX), tmp_path / "c.safetensors", str(tiny))
    other = tiny_model_factory("mixtral", layers=3)
    r = subprocess.run([sys.executable, "-m", "edge0", "generate", "--model", str(other), "--prompt", "x",
                        "--prompt-cache-file", path], capture_output=True, text=True)
    assert r.returncode != 0 and f"was made with the model {tiny}, not {other}" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "edge0", "generate", "--prompt", "x"], capture_output=True, text=True)
    assert r.returncode != 0 and "--model is required" in r.stderr, r.stderr


# Files crafted as a red team did: a valid cache file, its header rewritten. mlx's
# tree_unflatten pads a list up to the largest index a name holds, so each of these cost
# gigabytes (or loaded as something else) before the layout was checked first.
def _key(key: str, value: str):
    return lambda tensors, meta: meta.__setitem__(key, value)


def _renamed(old: str, new: str):
    def mutate(tensors, meta):
        next(t for t in tensors if t["name"] == old)["name"] = new
    return mutate


CRAFTED = {
    "a huge layer in a class key": (_key("1.50000000", "KVCache"),
                                    "metadata key '1.50000000' names layer 50000000, but the file's tensors hold "
                                    "{layers} layers"),
    "a leading zero": (_key("1.01", "KVCache"),
                       "metadata key '1.01': '01' is not a layer index (a plain decimal number)"),
    "a sign": (_key("1.-1", "KVCache"), "metadata key '1.-1': '-1' is not a layer index (a plain decimal number)"),
    "an exponent": (_key("1.1e3", "KVCache"),
                    "metadata key '1.1e3': '1e3' is not a layer index (a plain decimal number)"),
    "an unknown class": (_key("1.0", "Bogus"),
                         "metadata key '1.0' names the cache class 'Bogus', which mlx-lm's cache module does not "
                         "define"),
    "a huge layer in a tensor name": (_renamed("0.2", "50000000.0"),
                                      "tensor name '50000000.0' names layer 50000000, but the file names the cache "
                                      "class of {layers} layers"),
    "a huge state element": (_renamed("0.2", "0.50000000"),
                             "tensor name '0.50000000' names element 50000000 of layer 0's state, which has 3 elements "
                             "in this file"),
    "a leading zero in a tensor name": (_renamed("0.2", "0.02"),
                                        "tensor name '0.02': '02' is not an index (a plain decimal number)"),
    "a huge scalar record": (_key("2.50000000.1", "scalar"),
                             "metadata key '2.50000000.1' names record 50000000, but the file holds {records} records "
                             "('2.0' and '2.<n>.0' / '2.<n>.1')"),
    "a huge index in the caller's metadata": (_key("0.50000000", "x"),
                                              "metadata key '0.50000000': '50000000' reads as a list index, which must "
                                              "be a plain decimal number below 3 (the names at its level)"),
}


@pytest.fixture(scope="module")
def cache_file(tiny, reference, tmp_path_factory) -> Path:
    """A valid cache file of the tiny model, as mlx_lm.cache_prompt writes it."""
    ref, tok = reference
    return Path(_cache_file(ref, tok.encode(PREFIX), tmp_path_factory.mktemp("cache") / "valid.safetensors", str(tiny)))


def _never(*args, **kwargs):
    pytest.fail("mlx-lm's load_prompt_cache was called on a crafted file")


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_cache_file_is_refused_before_mlx_lm_reads_it(case, cache_file, tmp_path, monkeypatch):
    """One line naming the file and the key, raised before mlx-lm's loader runs (it would
    build the padded lists)."""
    import mlx_lm.models.cache as mlx_cache

    layers = len(load_prompt_cache(str(cache_file)))
    mutate, message = CRAFTED[case]
    path = rewrite_header(cache_file, tmp_path / "crafted.safetensors", mutate)
    monkeypatch.setattr(mlx_cache, "load_prompt_cache", _never)
    with pytest.raises(ConfigError) as e:
        bnn.load_cache_file(path)
    assert str(e.value) == f"prompt cache file {path}: " + message.format(layers=layers, records=layers + 2)


_LOAD = ("import sys\nfrom edge0.backend import nn as bnn\nfrom edge0.errors import ConfigError\n"
         "try:\n    cache, meta = bnn.load_cache_file(sys.argv[1])\nexcept ConfigError as e:\n    print(e)\n"
         "else:\n    print(len(cache), 'layers', sorted(meta))")


def test_a_crafted_cache_file_costs_no_more_memory_than_a_valid_one(cache_file, tmp_path):
    """Peak memory of each load in a process of its own (a smaller index than the red
    team's, so that a regression costs hundreds of megabytes, not gigabytes); the valid
    file still loads as mlx-lm loads it."""
    crafted = rewrite_header(cache_file, tmp_path / "crafted.safetensors", _key("1.5000000", "KVCache"))
    said, valid_kib = peak_rss(_LOAD, cache_file)
    layers = len(load_prompt_cache(str(cache_file)))
    assert said == f"{layers} layers ['model', 'tokenizer_config']"
    said, crafted_kib = peak_rss(_LOAD, crafted)
    assert said == (f"prompt cache file {crafted}: metadata key '1.5000000' names layer 5000000, but the file's "
                    f"tensors hold {layers} layers")
    assert crafted_kib < 2 * valid_kib, (crafted_kib, valid_kib)
    ours, theirs = bnn.load_cache_file(cache_file), load_prompt_cache(str(cache_file), return_metadata=True)
    assert ours[1] == theirs[1] and [type(c) for c in ours[0]] == [type(c) for c in theirs[0]]
    for a, b in zip(ours[0], theirs[0]):
        assert a.offset == b.offset and all(mx.array_equal(x, y).item() for x, y in zip(a.state[:2], b.state[:2]))


def test_the_command_line_refuses_a_crafted_cache_file_in_one_line(cache_file, tmp_path):
    """``edge0 generate --prompt-cache-file`` with the red team's file: exit status 2 and
    one line on stderr, no traceback."""
    layers = len(load_prompt_cache(str(cache_file)))
    path = rewrite_header(cache_file, tmp_path / "crafted.safetensors", _key("1.50000000", "KVCache"))
    r = subprocess.run([sys.executable, "-m", "edge0", "generate", "--prompt", "x", "--prompt-cache-file", str(path)],
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr == (f"edge0: error: prompt cache file {path}: metadata key '1.50000000' names layer 50000000, but "
                        f"the file's tensors hold {layers} layers\n")
    assert r.stdout == ""
