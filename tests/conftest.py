"""Shared fixtures: tiny random int4 checkpoints of every family, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

FAMILIES = ("qwen3_moe", "qwen3_5_moe", "mixtral", "deepseek_v3", "bailing_moe", "glm4_moe_lite")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``make(family, **overrides) -> Path``; each distinct request is built once."""
    from edge0.tiny import make_tiny

    built: dict[tuple, Path] = {}

    def make(family: str, **overrides) -> Path:
        key = (family, tuple(sorted(overrides.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{family}")
            built[key] = make_tiny(family, out, seed=0, overwrite=True, **overrides)
        return built[key]

    return make


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def tiny_model(tiny_model_factory, family) -> Path:
    return tiny_model_factory(family)
