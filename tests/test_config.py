"""EngineConfig from every source: TOML, environment, CLI flags, keyword overrides."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from pathlib import Path

import pytest

from edge0.config import EngineConfig
from edge0.config_sources.cli_flags import add_config_flags, config_from_args
from edge0.config_sources.docs_table import config_table_markdown
from edge0.config_sources.fields import env_var, field_docs, flag
from edge0.config_sources.resolve import resolve_config
from edge0.config_sources.toml_env import config_from_env, config_from_toml
from edge0.errors import ConfigError

DOCS = Path(__file__).resolve().parent.parent / "docs" / "CONFIG.md"
START, END = "<!-- config-table:start -->", "<!-- config-table:end -->"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edge0-test")
    add_config_flags(p)
    return p


def parse(*argv: str) -> argparse.Namespace:
    return parser().parse_args(list(argv))


def write(tmp_path: Path, text: str, name: str = "edge0.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- names and docs

def test_names():
    assert env_var("bundle_capacity") == "EDGE0_BUNDLE_CAPACITY"
    assert flag("bundle_capacity") == "--bundle-capacity"
    assert flag("compute_dtype") == "--compute-dtype"


def test_field_docs_cover_every_field_with_its_comment():
    docs = field_docs()
    assert list(docs) == [f.name for f in fields(EngineConfig)]
    assert all(docs.values()), [k for k, v in docs.items() if not v]
    # a two-line comment is joined
    assert docs["compute_dtype"].startswith("Activation dtype.")
    assert "bf16 activations is about 8x slower" in docs["compute_dtype"]
    assert "\n" not in docs["compute_dtype"] and "#" not in docs["compute_dtype"]
    # every field has its own comment (the --help of a flag is not its neighbour's)
    assert len(set(docs.values())) == len(docs)
    assert "prefill" in docs["prefill_path"] and "Log level" in docs["log_level"]
    assert docs["reader_threads"] == "Threads issuing positional reads of expert byte ranges."


def test_docs_table_matches_code():
    text = DOCS.read_text()
    assert text.count(START) == 1 and text.count(END) == 1
    between = text.split(START, 1)[1].split(END, 1)[0]
    assert between.strip("\n") == config_table_markdown().strip("\n"), \
        "docs/CONFIG.md is stale: paste config_table_markdown() between the markers"


def test_docs_toml_example_is_valid(tmp_path):
    blocks = re.findall(r"```toml\n(.*?)```", DOCS.read_text(), re.S)
    assert blocks
    for block in blocks:
        EngineConfig(**config_from_toml(write(tmp_path, block)))


def test_table_rows():
    table = config_table_markdown().splitlines()
    assert table[0] == "| field | default | CLI flag | environment variable | meaning |"
    rows = table[2:]
    assert [r.split("|")[1].strip().strip("`") for r in rows] == [f.name for f in fields(EngineConfig)]
    by_name = {r.split("|")[1].strip().strip("`"): r for r in rows}
    assert '`"auto"`' in by_name["compute_dtype"]
    assert "`32`" in by_name["bundle_capacity"] and "`--bundle-capacity`" in by_name["bundle_capacity"]
    assert "`EDGE0_BUNDLE_CAPACITY`" in by_name["bundle_capacity"]
    assert "`None`" in by_name["memory_budget_mb"]
    assert "`none`" in by_name["layer_paths"] and "--layer-path" in by_name["layer_paths"]


# --------------------------------------------------------------------------- each source alone

def test_defaults_when_nothing_is_set():
    assert resolve_config(environ={}) == EngineConfig()
    assert resolve_config(parse(), environ={}) == EngineConfig()


def test_toml_top_level(tmp_path):
    path = write(tmp_path, 'compute_dtype = "bfloat16"\nbundle_capacity = 8\noracle_file = "r.json"\n')
    assert config_from_toml(path) == {"compute_dtype": "bfloat16", "bundle_capacity": 8, "oracle_file": "r.json"}
    cfg = resolve_config(toml_path=path, environ={})
    assert (cfg.compute_dtype, cfg.bundle_capacity, cfg.oracle_file) == ("bfloat16", 8, "r.json")
    assert cfg.reader_threads == EngineConfig().reader_threads


def test_toml_engine_table_and_layer_paths(tmp_path):
    path = write(tmp_path, '[engine]\nhot_experts = 4\n'
                           'layer_paths = [[3, "decode", "hot"], [5, "prefill", "exact"]]\n')
    assert config_from_toml(path) == {"hot_experts": 4,
                                      "layer_paths": ((3, "decode", "hot"), (5, "prefill", "exact"))}
    cfg = resolve_config(toml_path=path, environ={})
    assert cfg.path_for(3, "decode") == "hot" and cfg.path_for(5, "prefill") == "exact"


def test_toml_mixed_top_level_and_engine_table(tmp_path):
    path = write(tmp_path, 'reader_threads = 3\n[engine]\nprefetch_depth = 2\n')
    assert config_from_toml(path) == {"reader_threads": 3, "prefetch_depth": 2}


def test_toml_layer_paths_as_strings(tmp_path):
    path = write(tmp_path, 'layer_paths = ["3:decode=hot", [4, "decode", "whole_layer"]]\n')
    assert config_from_toml(path)["layer_paths"] == ((3, "decode", "hot"), (4, "decode", "whole_layer"))


def test_toml_from_config_flag_and_from_env(tmp_path):
    path = write(tmp_path, "bundle_capacity = 5\n")
    assert resolve_config(parse("--config", str(path)), environ={}).bundle_capacity == 5
    assert resolve_config(environ={"EDGE0_CONFIG": str(path)}).bundle_capacity == 5
    # toml_path beats --config beats EDGE0_CONFIG (only one file is read)
    other = write(tmp_path, "bundle_capacity = 6\n", "other.toml")
    assert resolve_config(parse("--config", str(other)), environ={"EDGE0_CONFIG": str(path)}).bundle_capacity == 6
    assert resolve_config(parse("--config", str(other)), environ={}, toml_path=path).bundle_capacity == 5
    # an empty EDGE0_CONFIG names no file
    assert resolve_config(environ={"EDGE0_CONFIG": ""}) == EngineConfig()


def test_env():
    environ = {"EDGE0_BUNDLE_CAPACITY": "8", "EDGE0_DECODE_PATH": "hot", "EDGE0_MEMORY_BUDGET_MB": "512",
               "EDGE0_ORACLE_FILE": "routing.json", "EDGE0_LAYER_PATHS": "3:decode=hot,5:prefill=exact",
               "PATH": "/usr/bin", "OTHER_BUNDLE_CAPACITY": "x"}
    assert config_from_env(environ) == {
        "bundle_capacity": 8, "decode_path": "hot", "memory_budget_mb": 512, "oracle_file": "routing.json",
        "layer_paths": ((3, "decode", "hot"), (5, "prefill", "exact"))}
    cfg = resolve_config(environ=environ)
    assert cfg.bundle_capacity == 8 and cfg.path_for(5, "prefill") == "exact" and cfg.path_for(5, "decode") == "hot"


def test_env_int_forms():
    assert config_from_env({"EDGE0_HOT_EXPERTS": " 12 "}) == {"hot_experts": 12}
    assert config_from_env({"EDGE0_HOT_EXPERTS": "+3"}) == {"hot_experts": 3}


@pytest.mark.parametrize("text", ["none", "None", "NONE", ""])
def test_env_none_for_optional_fields(text):
    assert config_from_env({"EDGE0_MEMORY_BUDGET_MB": text, "EDGE0_ORACLE_FILE": text}) == \
        {"memory_budget_mb": None, "oracle_file": None}


def test_env_empty_layer_paths_is_empty():
    assert config_from_env({"EDGE0_LAYER_PATHS": ""}) == {"layer_paths": ()}


def test_env_ignores_other_edge0_variables(tmp_path):
    environ = {"EDGE0_CACHE": str(tmp_path), "EDGE0_NOT_A_FIELD": "x", "EDGE0_CONFIG": ""}
    assert config_from_env(environ) == {}
    assert resolve_config(environ=environ) == EngineConfig()


def test_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("EDGE0_PREFETCH_DEPTH", "7")
    monkeypatch.delenv("EDGE0_CONFIG", raising=False)
    assert config_from_env()["prefetch_depth"] == 7
    assert resolve_config().prefetch_depth == 7


def test_cli_flags_parse_with_argparse():
    args = parse("--compute-dtype", "float16", "--bundle-capacity", "8", "--memory-budget-mb", "256",
                 "--oracle-file", "r.json", "--layer-path", "3:decode=hot", "--layer-path", "5:prefill=exact")
    assert args.bundle_capacity == 8 and args.memory_budget_mb == 256
    assert config_from_args(args) == {
        "compute_dtype": "float16", "bundle_capacity": 8, "memory_budget_mb": 256, "oracle_file": "r.json",
        "layer_paths": ((3, "decode", "hot"), (5, "prefill", "exact"))}
    cfg = resolve_config(args, environ={})
    assert cfg.compute_dtype == "float16" and cfg.path_for(3, "decode") == "hot"


def test_cli_absent_flags_are_none_and_override_nothing():
    args = parse()
    for f in fields(EngineConfig):
        assert getattr(args, f.name) is None
    assert args.config is None
    assert config_from_args(args) == {}


def test_cli_none_overrides_lower_sources(tmp_path):
    path = write(tmp_path, 'memory_budget_mb = 100\noracle_file = "a.json"\n')
    args = parse("--memory-budget-mb", "none", "--oracle-file", "none")
    assert config_from_args(args) == {"memory_budget_mb": None, "oracle_file": None}
    cfg = resolve_config(args, environ={}, toml_path=path)
    assert cfg.memory_budget_mb is None and cfg.oracle_file is None


def test_cli_layer_path_comma_list_and_alias():
    args = parse("--layer-path", "3:decode=hot,4:decode=exact", "--layer-paths", "5:prefill=whole_layer")
    assert config_from_args(args)["layer_paths"] == ((3, "decode", "hot"), (4, "decode", "exact"),
                                                     (5, "prefill", "whole_layer"))


def test_cli_help_text():
    actions = {a.dest: a for a in parser()._actions}
    docs = field_docs()
    for f in fields(EngineConfig):
        assert actions[f.name].default is None
        assert f"env {env_var(f.name)}" in actions[f.name].help
        assert docs[f.name] in actions[f.name].help
    assert '(default: "auto"; env EDGE0_COMPUTE_DTYPE)' in actions["compute_dtype"].help
    assert "(default: 32; env EDGE0_BUNDLE_CAPACITY)" in actions["bundle_capacity"].help
    assert actions["compute_dtype"].choices == ("auto", "float32", "bfloat16", "float16")
    assert "hot" in actions["decode_path"].choices and "json" in actions["log_format"].choices
    assert actions["staged_source"].choices == ("auto", "oracle", "prerouter")
    assert actions["prerouter"].choices == ("auto", "on", "off")
    assert "--layer-path" in actions["layer_paths"].option_strings
    parser().format_help()  # renders (no stray % in help strings)


def test_config_from_args_plain_namespace():
    # a Namespace not built by add_config_flags' parser: None means "not given"
    ns = argparse.Namespace(bundle_capacity=4, compute_dtype=None, layer_paths=["2:decode=hot"], other="x")
    assert config_from_args(ns) == {"bundle_capacity": 4, "layer_paths": ((2, "decode", "hot"),)}


def test_keyword_overrides():
    cfg = resolve_config(environ={}, bundle_capacity=3, layer_paths=[[1, "decode", "hot"]], memory_budget_mb=None)
    assert cfg.bundle_capacity == 3 and cfg.layer_paths == ((1, "decode", "hot"),)


# --------------------------------------------------------------------------- precedence

def test_precedence_highest_wins_lower_survive(tmp_path):
    path = write(tmp_path, "\n".join([
        "bundle_capacity = 10",       # set at every level
        "reader_threads = 10",        # TOML, env, CLI
        "prefill_step_size = 10",     # TOML, env
        "hot_experts = 10",           # TOML only
        'layer_paths = [[1, "decode", "hot"]]',
        'oracle_file = "from-toml.json"',
    ]) + "\n")
    environ = {"EDGE0_CONFIG": str(path), "EDGE0_BUNDLE_CAPACITY": "20", "EDGE0_READER_THREADS": "20",
               "EDGE0_PREFILL_STEP_SIZE": "20", "EDGE0_LAYER_PATHS": "2:decode=hot", "EDGE0_PREFETCH_DEPTH": "20"}
    args = parse("--bundle-capacity", "30", "--reader-threads", "30", "--layer-path", "3:decode=exact")
    cfg = resolve_config(args, environ=environ, bundle_capacity=40)
    assert cfg.bundle_capacity == 40          # override > CLI > env > TOML
    assert cfg.reader_threads == 30           # CLI > env > TOML
    assert cfg.prefill_step_size == 20        # env > TOML
    assert cfg.prefetch_depth == 20           # env only
    assert cfg.hot_experts == 10              # TOML only survives
    assert cfg.oracle_file == "from-toml.json"
    assert cfg.layer_paths == ((3, "decode", "exact"),)  # replaced whole, not merged
    assert cfg.compute_dtype == EngineConfig().compute_dtype  # set nowhere: default

    # drop the top layers one at a time
    assert resolve_config(args, environ=environ).bundle_capacity == 30
    assert resolve_config(parse(), environ=environ).bundle_capacity == 20
    assert resolve_config(parse(), environ={"EDGE0_CONFIG": str(path)}).bundle_capacity == 10


def test_env_none_overrides_toml(tmp_path):
    path = write(tmp_path, "memory_budget_mb = 100\n")
    assert resolve_config(environ={"EDGE0_MEMORY_BUDGET_MB": "none"}, toml_path=path).memory_budget_mb is None


# --------------------------------------------------------------------------- errors: TOML

def test_toml_missing_file(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=re.escape(f"TOML file {missing}: file not found")):
        config_from_toml(missing)
    with pytest.raises(ConfigError, match="nope.toml"):
        resolve_config(environ={"EDGE0_CONFIG": str(missing)})


def test_toml_syntax_error(tmp_path):
    path = write(tmp_path, "bundle_capacity = = 3\n")
    with pytest.raises(ConfigError, match=re.escape(f"TOML file {path}: invalid TOML: ") + r".*line 1"):
        config_from_toml(path)


def test_toml_unknown_key_lists_valid_fields(tmp_path):
    path = write(tmp_path, "bundle_capacty = 3\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'bundle_capacty'.*valid fields: compute_dtype, "
                                          r"bundle_capacity.*log_level") as info:
        config_from_toml(path)
    assert str(path) in str(info.value)
    path = write(tmp_path, "[engine]\nfoo = 1\n", "b.toml")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'foo' at \[engine\]"):
        config_from_toml(path)
    path = write(tmp_path, "[other]\nfoo = 1\n", "c.toml")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'other' at top level"):
        config_from_toml(path)


def test_toml_key_at_top_level_and_in_engine(tmp_path):
    path = write(tmp_path, "hot_experts = 1\n[engine]\nhot_experts = 2\n")
    with pytest.raises(ConfigError, match=r"field hot_experts is set both at top level and under \[engine\]"):
        config_from_toml(path)


def test_toml_engine_not_a_table(tmp_path):
    with pytest.raises(ConfigError, match=r"'engine' must be a table"):
        config_from_toml(write(tmp_path, "engine = 3\n"))


@pytest.mark.parametrize("value, shown", [('"abc"', "'abc'"), ("8.0", "8.0"), ("true", "True")])
def test_toml_int_field_wrong_type(tmp_path, value, shown):
    path = write(tmp_path, f"bundle_capacity = {value}\n")
    with pytest.raises(ConfigError, match=re.escape(f"TOML file {path}: field bundle_capacity expects an "
                                                    f"integer, got {shown}")):
        config_from_toml(path)


def test_toml_optional_int_and_str_wrong_type(tmp_path):
    with pytest.raises(ConfigError, match="field memory_budget_mb expects an integer or none, got 'big'"):
        config_from_toml(write(tmp_path, 'memory_budget_mb = "big"\n'))
    with pytest.raises(ConfigError, match="field compute_dtype expects a string, got 3"):
        config_from_toml(write(tmp_path, "compute_dtype = 3\n", "b.toml"))
    with pytest.raises(ConfigError, match="field oracle_file expects a string or none, got 3"):
        config_from_toml(write(tmp_path, "oracle_file = 3\n", "c.toml"))


@pytest.mark.parametrize("value", ['"3:decode=hot"', "[[3, \"decode\"]]", '[["3", "decode", "hot"]]',
                                   '[[true, "decode", "hot"]]', "[[3, 4, 5]]", "[3]"])
def test_toml_bad_layer_paths(tmp_path, value):
    path = write(tmp_path, f"layer_paths = {value}\n")
    with pytest.raises(ConfigError, match=re.escape(f"TOML file {path}: field layer_paths")):
        config_from_toml(path)


def test_toml_bad_layer_path_string(tmp_path):
    path = write(tmp_path, 'layer_paths = ["3-decode-hot"]\n')
    with pytest.raises(ConfigError, match=r"field layer_paths: expected LAYER:PHASE=PATH .*'3-decode-hot'"):
        config_from_toml(path)


# --------------------------------------------------------------------------- errors: environment

@pytest.mark.parametrize("text", ["8.0", "x", "", "1e3", "1_000", "none"])
def test_env_bad_int(text):
    with pytest.raises(ConfigError, match=re.escape(f"environment variable EDGE0_BUNDLE_CAPACITY: field "
                                                    f"bundle_capacity expects an integer, got {text!r}")):
        config_from_env({"EDGE0_BUNDLE_CAPACITY": text})


def test_env_bad_optional_int():
    with pytest.raises(ConfigError, match=r"EDGE0_MEMORY_BUDGET_MB: field memory_budget_mb expects an integer "
                                          r"or none, got '1.5'"):
        config_from_env({"EDGE0_MEMORY_BUDGET_MB": "1.5"})


@pytest.mark.parametrize("text", ["3:decode", "decode=hot", "3=decode:hot", "x:decode=hot", "3:decode=hot;4:decode=hot"])
def test_env_bad_layer_paths(text):
    with pytest.raises(ConfigError, match=r"environment variable EDGE0_LAYER_PATHS: field layer_paths: "
                                          r"expected LAYER:PHASE=PATH \(e\.g\. 3:decode=hot\)"):
        config_from_env({"EDGE0_LAYER_PATHS": text})


# --------------------------------------------------------------------------- errors: CLI

@pytest.mark.parametrize("value", ["3", "3:decode", "three:decode=hot", "3:decode=hot=x"])
def test_cli_bad_layer_path(value):
    args = parse("--layer-path", value)
    with pytest.raises(ConfigError, match=r"flag --layer-path: expected LAYER:PHASE=PATH \(e\.g\. 3:decode=hot\)"):
        config_from_args(args)
    with pytest.raises(ConfigError, match="flag --layer-path"):
        resolve_config(args, environ={})


@pytest.mark.parametrize("argv, fragment", [
    (["--bundle-capacity", "x"], "argument --bundle-capacity: invalid int value: 'x'"),
    (["--memory-budget-mb", "1.5"], "argument --memory-budget-mb: invalid integer-or-none value: '1.5'"),
    (["--compute-dtype", "int8"], "argument --compute-dtype: invalid choice: 'int8'"),
    (["--decode-path", "fast"], "argument --decode-path: invalid choice: 'fast'"),
])
def test_cli_bad_values_rejected_by_argparse(argv, fragment, capsys):
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2
    assert fragment in capsys.readouterr().err


# --------------------------------------------------------------------------- errors: validation

def test_unknown_keyword_override():
    with pytest.raises(ConfigError, match=r"unknown keyword\(s\) 'bundle'.*valid fields: compute_dtype"):
        resolve_config(environ={}, bundle=3)


def test_keyword_override_wrong_type():
    with pytest.raises(ConfigError, match="keyword override: field bundle_capacity expects an integer, got '8'"):
        resolve_config(environ={}, bundle_capacity="8")
    with pytest.raises(ConfigError, match="keyword override: field hot_experts expects an integer, got True"):
        resolve_config(environ={}, hot_experts=True)


def test_validation_error_names_field_and_source(tmp_path):
    with pytest.raises(ConfigError, match=r"bundle_capacity must be a positive integer, got 0 "
                                          r"\(field bundle_capacity set by environment variable EDGE0_BUNDLE_CAPACITY\)"):
        resolve_config(environ={"EDGE0_BUNDLE_CAPACITY": "0"})
    path = write(tmp_path, 'compute_dtype = "int8"\n')
    with pytest.raises(ConfigError, match=r"compute_dtype must be auto, float32, bfloat16 or float16, got 'int8' "
                                          r"\(field compute_dtype set by TOML file .*edge0\.toml\)"):
        resolve_config(environ={}, toml_path=path)
    with pytest.raises(ConfigError, match=r"slots_per_layer must be 0 .* got -1 "
                                          r"\(field slots_per_layer set by flag --slots-per-layer\)"):
        resolve_config(parse("--slots-per-layer", "-1"), environ={})
    with pytest.raises(ConfigError, match=r"layer_paths: phase must be one of .* got 'decoding' "
                                          r"\(field layer_paths set by flag --layer-path\)"):
        resolve_config(parse("--layer-path", "3:decoding=hot"), environ={})
    with pytest.raises(ConfigError, match=r"layer_paths: path 'staged' is not valid for prefill "
                                          r"\(field layer_paths set by environment variable EDGE0_LAYER_PATHS\)"):
        resolve_config(environ={"EDGE0_LAYER_PATHS": "2:prefill=staged"})
    with pytest.raises(ConfigError, match=r"memory_budget_mb must be a positive integer, got -5 "
                                          r"\(field memory_budget_mb set by flag --memory-budget-mb\)"):
        resolve_config(parse("--memory-budget-mb", "-5"), environ={})
    with pytest.raises(ConfigError, match=r"log_level must be .* got 'loud' \(field log_level set by keyword override\)"):
        resolve_config(environ={}, log_level="loud")


def test_validation_runs_on_merged_values(tmp_path):
    # TOML's invalid value is replaced by a valid one from a higher source: no error
    path = write(tmp_path, "bundle_capacity = 0\n")
    assert resolve_config(environ={"EDGE0_BUNDLE_CAPACITY": "4"}, toml_path=path).bundle_capacity == 4


def test_adapter_flag_takes_several_directories():
    """``--adapter A B`` and ``--adapter A --adapter B``: A is the default, B stays resident."""
    import argparse

    from edge0.config_sources.cli_flags import add_config_flags

    p = argparse.ArgumentParser()
    add_config_flags(p)
    for argv in (["--adapter", "a", "b"], ["--adapter", "a", "--adapter", "b"]):
        c = resolve_config(p.parse_args(argv), environ={})
        assert (c.adapter, c.extra_adapters) == ("a", ("b",))
    c = resolve_config(p.parse_args(["--adapter", "a", "--extra-adapters", "c", "--adapter", "b"]), environ={})
    assert (c.adapter, set(c.extra_adapters)) == ("a", {"b", "c"})
    assert resolve_config(p.parse_args([]), environ={}, defaults={"prompt_cache_mb": 7}).prompt_cache_mb == 7
    assert resolve_config(p.parse_args(["--prompt-cache-mb", "0"]), environ={},
                          defaults={"prompt_cache_mb": 7}).prompt_cache_mb == 0


@pytest.mark.parametrize("value", [-1, True, 1.5, "8"])
def test_slot_budget_must_be_none_zero_or_mib(value):
    with pytest.raises(ConfigError, match=r"slot_budget_mb must be None \(4 x the slots at open\), 0 \(never grow\)"):
        EngineConfig(slot_budget_mb=value)


def test_prerouter_flush_is_auto_edge0_mlx_or_numpy():
    for good in ("auto", "edge0", "mlx", "numpy"):
        EngineConfig(prerouter_flush=good)
    with pytest.raises(ConfigError, match="prerouter_flush must be auto, edge0, mlx or numpy, got 'host'"):
        EngineConfig(prerouter_flush="host")


@pytest.mark.parametrize("value", [0, 101, -5, True, 0.5, "50"])
def test_prefill_share_is_a_whole_percentage(value):
    with pytest.raises(ConfigError, match=r"prefill_share must be a whole percentage from 1 to 100, got"):
        EngineConfig(prefill_share=value)
    assert EngineConfig(prefill_share=1).prefill_share == 1 and EngineConfig().prefill_share == 100


FREE_FORM = {"layer_paths", "oracle_file", "prerouter_file", "adapter", "extra_adapters", "pipeline_layers",
             "draft_model"}


def test_every_field_states_its_rule_and_the_one_loop_enforces_it():
    """Each field's doc, choices and bounds are its metadata: every field but the free-form
    ones has choices or an integer lower bound, and a value outside them is refused naming
    the field, what it must be and the value."""
    for f in fields(EngineConfig):
        m = f.metadata
        assert m["doc"], f.name
        if f.name in FREE_FORM:
            continue
        assert m["choices"] or m["lo"] is not None, f.name
        bad = [max((c for c in m["choices"] if isinstance(c, int)), default=0) + 99] \
            if m["choices"] and isinstance(m["choices"][0], int) else ["nonsense"] if m["choices"] else \
            [m["lo"] - 1, True, "3"] + ([m["hi"] + 1] if m["hi"] is not None else [])
        for value in bad:
            with pytest.raises(ConfigError, match=rf"^{f.name} must be .*, got {re.escape(repr(value))}$"):
                EngineConfig(**{f.name: value})


def test_an_optional_setting_takes_its_word_for_none_everywhere(tmp_path):
    """``--kv-bits off`` / ``--cache-mb auto``: a setting whose None has a one-word name takes
    that word on the command line, in the environment and in TOML (and ``none`` still)."""
    from edge0.config_sources.resolve import resolve_config

    p = argparse.ArgumentParser()
    add_config_flags(p)
    for argv in (["--cache-mb", "auto", "--kv-bits", "off"], ["--cache-mb", "none", "--kv-bits", "none"]):
        cfg = resolve_config(p.parse_args(argv), environ={"EDGE0_CACHE_MB": "7", "EDGE0_KV_BITS": "4"})
        assert cfg.cache_mb is None and cfg.kv_bits is None, argv  # the flags win over the environment
    env = resolve_config(environ={"EDGE0_CACHE_MB": "auto", "EDGE0_KV_BITS": "off"})
    assert env.cache_mb is None and env.kv_bits is None
    toml = tmp_path / "e.toml"
    toml.write_text('cache_mb = "auto"\nkv_bits = "off"\n')
    assert resolve_config(toml_path=toml, environ={}).cache_mb is None
    assert resolve_config(toml_path=toml, environ={}).kv_bits is None
    assert resolve_config(p.parse_args(["--cache-mb", "64"]), environ={}).cache_mb == 64
    with pytest.raises(SystemExit):  # another word is no integer
        p.parse_args(["--cache-mb", "off"])
    with pytest.raises(ConfigError, match="cache_mb"):
        resolve_config(environ={"EDGE0_CACHE_MB": "off"})
