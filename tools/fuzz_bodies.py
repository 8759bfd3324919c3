"""Fuzz ``edge0 serve``'s request bodies: every answer must be a 2xx or a 4xx in OpenAI's
error shape, never a 5xx, and the server must log no traceback.

    python tools/fuzz_bodies.py [--bodies 3000] [--seed 0] [--serve-model DIR] [--template] [--out FILE]
    python tools/fuzz_bodies.py --url http://127.0.0.1:8080 [--bodies 3000]

A body is a valid chat or completion request with one to three mutations: a field (one the
server implements, or not) set to a hostile value (integers past float range, NaN, lone
surrogates as values and as keys, deep nesting, long lists, wrong types), a message or a
tool call bent the same way, ``chat_template_kwargs`` naming the renderer's own parameters
or the template's variables, or the bytes themselves broken (cut, not UTF-8, not an object).
``--template`` serves a copy of the model with a chat template that has a tool-call format
and reads a variable (the default model has no template). The server is started on a free
port and stopped after (``--serve-model``, the demo by default), or given by ``--url``.
Prints a summary (statuses, 5xx bodies, tracebacks logged) and writes ``--out`` as JSON;
exits 1 when any 5xx or traceback was seen.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

FIELDS = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
          "repetition_penalty", "repetition_context_size", "presence_penalty", "frequency_penalty",
          "xtc_probability", "xtc_threshold", "logit_bias", "response_format", "stop", "stream", "stream_options",
          "user", "cache_salt", "n", "adapters", "logprobs", "top_logprobs", "tools", "tool_choice",
          "chat_template_kwargs", "role_mapping", "messages", "prompt", "echo", "unknown_field"]
TEMPLATE_KEYS = ["chat_template", "continue_final_message", "return_assistant_tokens_mask", "documents",
                 "tokenize", "messages", "tools", "enable_thinking", "tone", "max_length", "padding"]
SURROGATE = "\ud800"


def hostile_value(rng: random.Random, depth: int = 0):
    kinds = ["none", "bool", "int", "huge_int", "neg_huge_int", "float", "nan", "inf", "str", "surrogate",
             "long_str", "list", "dict", "surrogate_key", "deep", "long_list"]
    kind = rng.choice(kinds if depth < 2 else kinds[:11])
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, 1, -1, 2, 7, 255, 2**31, 2**53 + 1, 2**63, -2**63 - 1, 2**64])
    if kind == "huge_int":
        return int("9" * rng.choice([20, 310, 400, 4000]))
    if kind == "neg_huge_int":
        return -int("9" * rng.choice([20, 400]))
    if kind == "float":
        return rng.choice([0.0, -0.0, 0.5, 1.5, -2.5, 1e-320, 1e308, 3.4e38])
    if kind == "nan":
        return float("nan")
    if kind == "inf":
        return rng.choice([float("inf"), float("-inf")])
    if kind == "str":
        return rng.choice(["", "x", "0", "1.5", "true", "null", "{}", "<|im_start|>", "\x00", "é" * 3])
    if kind == "surrogate":
        return "a" + SURROGATE + "b"
    if kind == "long_str":
        return "y" * rng.choice([1000, 100_000])
    if kind == "list":
        return [hostile_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "dict":
        return {rng.choice(["a", "type", "name", "1", ""]): hostile_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    if kind == "surrogate_key":
        return {SURROGATE: hostile_value(rng, depth + 1)}
    if kind == "deep":
        v: object = 1
        for _ in range(rng.choice([10, 70, 200])):
            v = [v] if rng.random() < 0.5 else {"a": v}
        return v
    return [0] * rng.choice([1000, 70_000])


def base_body(rng: random.Random, route: str) -> dict:
    body: dict = {"max_tokens": rng.choice([1, 2, 3]), "temperature": 0}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt"] = "def f(x):"
    if rng.random() < 0.2:
        body["stream"] = True
    return body


def mutate(rng: random.Random, body: dict, route: str) -> None:
    what = rng.choice(["field", "field", "message", "tool_call", "template_kwargs", "logit_bias",
                       "response_format", "prompt_ids"])
    messages = body.get("messages")
    if what in ("message", "tool_call") and not (isinstance(messages, list) and messages
                                                 and all(isinstance(m, dict) for m in messages)):
        what = "field"  # an earlier mutation replaced the messages
    if what == "field":
        body[rng.choice(FIELDS)] = hostile_value(rng)
    elif what == "message" and route == "chat":
        m = rng.choice(body["messages"])
        m[rng.choice(["role", "content", "name", "tool_calls", "tool_call_id", SURROGATE])] = hostile_value(rng)
    elif what == "tool_call" and route == "chat":
        args = rng.choice([hostile_value(rng), json.dumps({SURROGATE: 1}), '{"\\ud800": 1}', "{", "[]", "1" * 400])
        body["messages"] += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": rng.choice(["f", 5, ""]), "arguments": args}}]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    elif what == "template_kwargs":
        body["chat_template_kwargs"] = {rng.choice(TEMPLATE_KEYS): hostile_value(rng) for _ in range(rng.randint(1, 2))}
    elif what == "logit_bias":
        body["logit_bias"] = {rng.choice(["1", "-1", "x", "99999999", "1" * 30]): hostile_value(rng)}
    elif what == "response_format":
        body["response_format"] = rng.choice([
            hostile_value(rng), {"type": hostile_value(rng)}, {"type": "json_schema", "json_schema": hostile_value(rng)},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": hostile_value(rng)}}])
    else:
        body["prompt"] = [rng.choice([0, 1, -1, 2**40, 10**400, "a", None]) for _ in range(rng.randint(1, 4))]


def encode(rng: random.Random, body: dict) -> bytes:
    raw = rng.random() < 0.3  # a lone surrogate as raw bytes (not UTF-8) rather than escaped (valid JSON)
    data = json.dumps(body, allow_nan=True, ensure_ascii=not raw).encode("utf-8", "surrogatepass")
    cut = rng.random()
    if cut < 0.04:
        return data[:rng.randint(0, len(data))]
    if cut < 0.06:
        return rng.choice([b"[]", b"1", b"null", b'"x"', b"\xff\xfe", b""])
    return data


def bodies(seed: int, n: int):
    """``n`` fuzzed (route, body bytes), reproducible from ``seed``."""
    rng = random.Random(seed)
    for _ in range(n):
        route = rng.choice(["chat", "completion"])
        body = base_body(rng, route)
        for _ in range(rng.randint(1, 3)):
            mutate(rng, body, route)
        yield route, encode(rng, body)


def send(url: str, route: str, data: bytes, timeout: float = 60.0) -> tuple[int, str]:
    """(status, a server error's message or '') of one body; a stream's error events count as
    its status when they say ``server_error``."""
    import httpx

    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    r = httpx.post(url + path, content=data, headers={"Content-Type": "application/json"}, timeout=timeout)
    if r.status_code >= 500:
        return r.status_code, r.text[:300]
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream") and \
            '"server_error"' in r.text:
        return 500, r.text[-300:]
    if r.status_code >= 400:
        error = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") else None
        if not isinstance(error, dict) or not isinstance(error.get("message"), str):
            return 599, f"not OpenAI's error shape: {r.text[:200]}"
    return r.status_code, ""


def fuzz(url: str, seed: int, n: int) -> dict:
    statuses, failures = Counter(), []
    for i, (route, data) in enumerate(bodies(seed, n)):
        status, message = send(url, route, data)
        statuses[status] += 1
        if status >= 500:
            failures.append({"index": i, "route": route, "status": status, "message": message,
                             "body": data[:300].decode("utf-8", "replace")})
    return {"bodies": n, "seed": seed, "statuses": dict(sorted(statuses.items())), "failures": failures}


TOOL_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>"
                 "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"
                 "{% if tone is defined %}{{ tone }}{% endif %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def with_template(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TOOL_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return dst


def serve(model: Path, log, *flags: str) -> tuple[subprocess.Popen, str]:
    """``edge0 serve --model MODEL`` on a free loopback port, its output to ``log``: (process, URL)
    once ``/health`` answers."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "edge0", "serve", "--model", str(model), "--port", str(port), *flags],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"the server did not start (log: {log.name})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bodies", type=int, default=3000, help="bodies to send (default 3000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", default=None, help="a running server (else one is started)")
    p.add_argument("--serve-model", default=None, help="the model to serve (default: the demo model)")
    p.add_argument("--template", action="store_true", help="serve a copy with a chat template that has tool calls")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    proc, tracebacks = None, None
    with tempfile.TemporaryDirectory() as tmp:
        log = open(os.path.join(tmp, "server.log"), "w+")
        url = args.url
        if url is None:
            from edge0.cli import demo_model_dir

            model = Path(args.serve_model) if args.serve_model else demo_model_dir()
            if args.template:
                model = with_template(model, Path(tmp) / model.name)
            proc, url = serve(model, log)
        try:
            report = fuzz(url, args.seed, args.bodies)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)
                log.seek(0)
                text = log.read()
                tracebacks = text.count("Traceback") + text.count("server.internal_error")
        report.update(template=args.template, tracebacks_logged=tracebacks)
    print(json.dumps({k: v for k, v in report.items() if k != "failures"}, indent=1))
    for f in report["failures"][:10]:
        print(f"5xx: {f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 1 if report["failures"] or tracebacks else 0


if __name__ == "__main__":
    raise SystemExit(main())
