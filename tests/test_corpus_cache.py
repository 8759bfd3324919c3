"""The token streams training reads are built once and kept in Edge0's cache: the teacher's
corpus, rebuilt from a model's provenance, under its train stream's hash; standard-library
text in a model's own tokenizer, under what it depends on. A kept file is checked again
whenever it is read back."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from edge0.errors import ConfigError
from edge0.train import corpus as co
from edge0.train import heads as H
from edge0.train.data import corpus_tokens, token_streams


class _Built:
    def __init__(self, train, held):
        self.train_tokens, self.heldout_tokens = train, held

    def description(self):
        return {"heldout_token_stream_sha256": _sha(self.heldout_tokens), "train_tokens": int(self.train_tokens.size)}


def _sha(tokens) -> str:
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype="<u2").tobytes()).hexdigest()


@pytest.fixture
def model(tmp_path, monkeypatch):
    """A model directory whose provenance names a small corpus, and a count of rebuilds."""
    monkeypatch.setenv("EDGE0_CACHE", str(tmp_path / "cache"))
    train, held = np.arange(1, 300, dtype=np.uint16), np.arange(7, 40, dtype=np.uint16)
    d = tmp_path / "m"
    d.mkdir()
    (d / "provenance.json").write_text(json.dumps({
        "corpus": {"train_token_stream_sha256": _sha(train)},
        "train_config": {"heldout_fraction": 0.1, "vocab_size": 512}}))
    builds = []

    def build(fraction, vocab):
        builds.append((fraction, vocab))
        return _Built(train.copy(), held.copy())

    monkeypatch.setattr(co, "build_corpus", build)
    return d, train, held, builds


def test_the_corpus_is_built_once_and_read_back_whole(model):
    d, train, held, builds = model
    first = corpus_tokens(d)
    again = corpus_tokens(d)
    assert builds == [(0.1, 512)]
    for a, b in zip(first[:2], again[:2]):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert np.array_equal(again[0], train) and np.array_equal(again[1], held)
    assert again[2] == first[2]


@pytest.mark.parametrize("damage", ["train", "heldout", "truncated"])
def test_a_kept_corpus_that_does_not_hash_to_its_name_is_rebuilt(model, damage, tmp_path):
    d, train, held, builds = model
    corpus_tokens(d)
    (kept,) = (tmp_path / "cache" / "corpus").glob("*.npz")
    if damage == "truncated":
        kept.write_bytes(kept.read_bytes()[:100])
    else:
        with np.load(kept) as f:
            parts = {k: f[k] for k in f.files}
        parts[damage] = parts[damage].copy()
        parts[damage][3] += 1
        np.savez(kept, **parts)
    got = corpus_tokens(d)
    assert len(builds) == 2
    assert np.array_equal(got[0], train) and np.array_equal(got[1], held)


def test_an_unwritable_cache_only_keeps_nothing(model, tmp_path, monkeypatch):
    d, train, _, builds = model
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("EDGE0_CACHE", str(blocker))  # a file where the cache's folder would be
    assert np.array_equal(corpus_tokens(d)[0], train)
    assert np.array_equal(corpus_tokens(d)[0], train)
    assert len(builds) == 2


def test_a_rebuilt_corpus_other_than_the_provenances_is_refused(model):
    d, *_ = model
    prov = json.loads((d / "provenance.json").read_text())
    prov["corpus"]["train_token_stream_sha256"] = "0" * 64
    (d / "provenance.json").write_text(json.dumps(prov))
    with pytest.raises(ConfigError, match="hash mismatch"):
        corpus_tokens(d)


@pytest.fixture
def tiny(tiny_model_factory, tmp_path, monkeypatch):
    """A tiny model without a provenance (a copy: its tokenizer is changed below), short
    texts in place of the standard library's, and a count of tokenizations."""
    from tests.ckpt_tools import copy_model

    monkeypatch.setenv("EDGE0_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(H, "default_texts", lambda: (["def f(x):\n    return x\n", "a = 1\n"], ["b = 2\n"], "texts"))
    from edge0.backend import nn as bnn

    loads = []
    real = bnn.load_tokenizer

    def load(path):
        loads.append(path)
        return real(path)

    monkeypatch.setattr(bnn, "load_tokenizer", load)
    return copy_model(tiny_model_factory("qwen3_moe"), tmp_path / "m"), loads


def test_texts_in_a_models_tokenizer_are_tokenized_once(tiny):
    d, loads = tiny
    first = token_streams(d)
    again = token_streams(d)
    assert len(loads) == 1
    assert again[2] == first[2] == "texts"
    for a, b in zip(first[:2], again[:2]):
        assert a.dtype == b.dtype == np.int64 and np.array_equal(a, b) and a.size > 0


def test_another_tokenizer_or_other_texts_are_tokenized_anew(tiny, monkeypatch):
    d, loads = tiny
    token_streams(d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = 77
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    token_streams(d)
    assert len(loads) == 2
    monkeypatch.setattr(H, "default_texts", lambda: (["c = 3\n"], ["b = 2\n"], "texts"))
    other = token_streams(d)
    assert len(loads) == 3
    token_streams(d)
    assert len(loads) == 3 and other[0].size < 8


def test_another_version_of_a_tokenizer_package_tokenizes_anew(tiny, monkeypatch):
    import importlib.metadata as md

    d, loads = tiny
    token_streams(d)
    real = md.version
    monkeypatch.setattr(md, "version", lambda name: "0.0-other" if name == "tokenizers" else real(name))
    token_streams(d)
    assert len(loads) == 2
