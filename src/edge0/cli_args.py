"""The command line's parser, and the flags of ``mlx_lm.generate`` that ``edge0 generate``
takes beyond its own.

A misspelt flag is answered by the subcommand it was given to (its usage, not the top
level's) with the nearest spelling it knows (``--max_tokens``: did you mean
``--max-tokens``?), exit status 2. argparse's subcommands hand what they do not know back
to the top-level parser, which printed only its own usage.

Every flag of ``mlx_lm.generate`` is known to ``edge0 generate``: honoured
(``MLX_HONOURED``), or accepted by the parser and refused, before anything loads, with the
reason (``MLX_REFUSED``). ``tests/test_cli_mlx_flags.py`` holds the two lists to the
installed mlx-lm's parser.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
from pathlib import Path

from edge0.errors import ConfigError, PackagedModelError

PACKAGED_DEMO = Path(__file__).resolve().parent / "data" / "demo_model"

# mlx.launch reads its own flags anywhere on its command line unless `--` ends them
LAUNCHER_ENV = ("MLX_RANK", "OMPI_COMM_WORLD_RANK")
LAUNCHER_HINT = ("under mlx.launch, put -- before the program: mlx.launch reads its own flags (--verbose, -p, -n, "
                 "--env, --cwd, --python, ...) anywhere on its command line unless -- ends them, so "
                 "`mlx.launch -n 2 edge0 generate --verbose false` hands edge0 a stray 'false' "
                 "(write `mlx.launch -n 2 -- edge0 generate ...`)")


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose subcommands refuse what they do not know themselves,
    with their own usage and a suggestion."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:  # a subcommand's parser is called with parse_known_args; nothing here wants extras back
            self.error(self.unknown_message(extras))
        return namespace, extras

    def unknown_message(self, extras: list[str]) -> str:
        message = f"unrecognized arguments: {' '.join(extras)}"
        hints = [hint for hint in map(self.suggestion, extras) if hint]
        if hints:
            message += " (" + "; ".join(hints) + ")"
        if any(name in os.environ for name in LAUNCHER_ENV):
            message += f"; {LAUNCHER_HINT}"
        return message

    def suggestion(self, given: str) -> str | None:
        """``did you mean --max-tokens?`` for a flag this parser does not know, or None."""
        if not given.startswith("--"):
            return None
        name = given.split("=", 1)[0]
        bare = name[2:].replace("_", "-")
        known = {s[2:]: s for action in self._actions for s in action.option_strings if s.startswith("--")}
        near = [bare] if bare in known else [k for k in known if len(k) >= 4 and bare.startswith(k)]
        near = near or difflib.get_close_matches(bare, list(known), n=1, cutoff=0.75)
        return f"{name}: did you mean {known[near[0]]}?" if near else None


# -- mlx_lm.generate's flags that Edge0's own flags (and EngineConfig's) do not already cover --

MLX_HONOURED = ("--xtc-probability", "--xtc-threshold", "--chat-template-config", "--use-default-chat-template")
MLX_REFUSED = {
    "--trust-remote-code": "Edge0 never runs code that comes with a model (a model folder holding .py files is "
                           "refused, docs/RELIABILITY.md); leave the flag out",
    "--image": "Edge0 serves text-only MoE models: there is no image input",
    "--quantize-activations": "Edge0 computes activations in --compute-dtype; quantized activations are not "
                              "implemented",
}


def add_mlx_generate_flags(p: argparse.ArgumentParser) -> None:
    """XTC sampling, the chat template's variables, and the mlx_lm.generate flags refused
    (``check_refused``)."""
    p.add_argument("--xtc-probability", type=float, default=0.0,
                   help="XTC sampling: the probability per step of dropping the likeliest tokens (default 0: off)")
    p.add_argument("--xtc-threshold", type=float, default=0.1,
                   help="XTC sampling: tokens above this probability are dropped, all but the least likely of "
                        "them, in [0, 0.5] (default 0.1)")
    p.add_argument("--chat-template-config", default=None, metavar="JSON",
                   help="the chat template's variables as a JSON object, e.g. '{\"enable_thinking\": false}'")
    p.add_argument("--use-default-chat-template", action="store_true",
                   help="accepted for mlx_lm.generate's command lines, and changes nothing, as there: the "
                        "tokenizer's own chat template is applied by default")
    refused = p.add_argument_group("mlx_lm.generate flags Edge0 refuses (with the reason)")
    refused.add_argument("--trust-remote-code", action="store_true", help=MLX_REFUSED["--trust-remote-code"])
    refused.add_argument("--image", nargs="+", default=None, metavar="FILE", help=MLX_REFUSED["--image"])
    refused.add_argument("--quantize-activations", "-qa", action="store_true",
                         help=MLX_REFUSED["--quantize-activations"])


def check_refused(args: argparse.Namespace) -> None:
    """A ``ConfigError`` naming the first refused mlx_lm.generate flag given, and why."""
    for flag, why in MLX_REFUSED.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value not in (None, False):
            raise ConfigError(f"{flag}: {why}")


def template_config(text: str | None) -> dict | None:
    """``--chat-template-config``: a JSON object of the chat template's variables."""
    from edge0.prompts import RENDERER_OWN

    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--chat-template-config is not JSON ({e}): give an object, e.g. "
                          "'{\"enable_thinking\": false}'") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--chat-template-config must be a JSON object of the chat template's variables, got "
                          f"{type(value).__name__}")
    own = sorted(set(value) & RENDERER_OWN)
    if own:
        raise ConfigError(f"--chat-template-config: {own[0]!r} is a parameter of the template renderer, which "
                          "edge0 sets itself; the config holds the chat template's variables")
    return value


def refuse_packaged_output(path: str | Path, what: str) -> None:
    """``PackagedModelError`` when ``path`` (what a command is about to write: ``what``) lies
    inside the demo model that ships in the package: writing there changes the installed
    package (and, in a clone, its tracked files), and new heads there make the engine refuse
    the adapter that ships beside them."""
    target = Path(path).resolve()
    if target == PACKAGED_DEMO or PACKAGED_DEMO in target.parents:
        raise PackagedModelError(f"{what} {path} is inside the demo model that ships in the package ({PACKAGED_DEMO}); "
                                 f"copy the model first (cp -r {PACKAGED_DEMO} DIR) and give --model DIR, or "
                                 "--out another path")
