#!/usr/bin/env python
"""Cost of JSON-constrained decoding (a logits mask per token) in llguidance, xgrammar and
outlines-core, on this machine's CPU.

For each library and tokenizer — the demo model's (byte-level BPE, 2048 tokens) and a
larger byte-level BPE trained offline on the top-level Python standard-library sources
(``--vocab``, 32768 by default, several comma-separated; cached under ``--cache-dir``) — it measures:

- ``setup``: turning the tokenizer into the library's vocabulary object (once per model);
- ``compile``: building the grammar of OpenAI's ``json_object`` (``{"type": "object"}``)
  and of a nested ``json_schema`` (required string / integer / enum / array of strings /
  array of objects / nested object fields) into a matcher, median over repeats;
- ``first mask``: the mask before the first token (lazy libraries do work here);
- per-token cost, median and p95 over a forced decode: a valid instance is tokenized
  (canonically), and before each token its mask is computed (``mask``) and then the token
  is consumed (``step`` = mask + consume); every token must be allowed by its mask and EOS
  must be allowed at the end (``ok``); per-step medians over the repeats;
- memory: the resident-set growth of setup and of the first compile (Linux ``/proc``).

Each (library, tokenizer) runs in its own subprocess, single-threaded (``--threads``), so
imports and memory do not mix; a library that is not installed gets an error row. Only
llguidance is an Edge0 dependency: ``pip install xgrammar outlines-core`` for the others
(xgrammar requires torch, which on Linux brings CUDA wheels of several GiB; uninstall
after). The llguidance rows also time Edge0's own processor (edge0/constrain.py) end to
end. Results of a run: docs/results/constrained-cost/.

    python tools/constrained_cost.py [--libs llguidance,xgrammar,outlines_core] [--vocab 32768,65536]
        [--repeats 5] [--out constrained_cost.json] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LIBS = ("llguidance", "xgrammar", "outlines_core")
DIST = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines_core": "outlines-core"}
COMPILE_BUDGET_S = 30.0  # stop repeating a compile once its repeats took this long

_ITEM = {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"},
                                          "price": {"type": "number"}},
         "required": ["sku", "qty", "price"], "additionalProperties": False}
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "status": {"type": "string", "enum": ["active", "inactive", "banned"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "items": {"type": "array", "items": _ITEM},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                    "required": ["street", "city"], "additionalProperties": False},
    },
    "required": ["name", "age", "status", "tags", "items", "address"],
    "additionalProperties": False,
}
NESTED_INSTANCE = {
    "name": "Ada Lovelace", "age": 36, "status": "active", "tags": ["math", "engines", "poetry"],
    "items": [{"sku": "AE-1843", "qty": 2, "price": 19.5}, {"sku": "BX-7", "qty": 10, "price": 0.25},
              {"sku": "note G", "qty": 1, "price": 1843.0}],
    "address": {"street": "12 St James's Square", "city": "London"},
}
# outlines-core's json_object regex nests at most 3 levels deep and has no \\u escapes:
# the instance stays within both (written with ensure_ascii=False).
OBJECT_INSTANCE = {
    "id": 4711, "title": "Crème brûlée recipe", "ok": True, "rating": 4.75, "deleted": None,
    "steps": ["heat the cream", "whisk the yolks", "bake at 150 C for 40 min"],
    "author": {"name": "Jules", "langs": ["fr", "en"], "verified": False},
    "reviews": [{"by": "ann", "stars": 5}, {"by": "bob", "stars": 3, "text": "too sweet"}],
}
GRAMMARS = {"json_object": ({"type": "object"}, OBJECT_INSTANCE),
            "json_schema": (NESTED_SCHEMA, NESTED_INSTANCE)}


def rss_mb() -> float:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


# ---- one adapter per library: setup(hf, eos) -> ctx; compile(ctx, schema) -> template;
# ---- matcher(template) -> m; fill(m, bitmask); consume(m, token) -> bool

class Llguidance:
    def __init__(self):
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.ll, self.hf, self.np = llguidance, llguidance.hf, llguidance.numpy

    def setup(self, hf, eos):
        return self.hf.from_tokenizer(hf, eos_token=eos)

    def compile(self, tok, schema):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema)
        m = self.ll.LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def matcher(self, template):
        return template.deep_copy()

    def fill(self, m, bitmask):
        self.np.fill_next_token_bitmask(m, bitmask, 0)

    def consume(self, m, token):
        return m.consume_token(token)


class Xgrammar:
    def __init__(self):
        import xgrammar

        self.xgr = xgrammar

    def setup(self, hf, eos):
        info = self.xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf), stop_token_ids=[eos])
        return self.xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, compiler, schema):
        # strict_mode=False: strict would forbid every property of {"type": "object"}
        return compiler.compile_json_schema(json.dumps(schema), strict_mode=schema != {"type": "object"})

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask):
        m.fill_next_token_bitmask(bitmask, 0)

    def consume(self, m, token):
        return m.accept_token(token)


class OutlinesCore:
    def __init__(self):
        import outlines_core

        self.oc = outlines_core

    def setup(self, hf, eos):
        self.eos = eos
        dec = byte_decoder()
        special = set(hf.all_special_ids)
        by_bytes: dict[bytes, list[int]] = {}
        for text, tid in hf.get_vocab().items():
            if tid in special or tid == eos:
                continue
            by_bytes.setdefault(bytes(dec[c] for c in text), []).append(tid)
        return self.oc.Vocabulary(eos, by_bytes)

    def compile(self, vocab, schema):
        return self.oc.Index(self.oc.json_schema.build_regex_from_schema(json.dumps(schema)), vocab)

    def matcher(self, index):
        return self.oc.Guide(index)

    def fill(self, m, bitmask):
        m.write_mask_into(bitmask.ctypes.data, bitmask.size, 4)

    def consume(self, m, token):
        if token == self.eos and m.is_finished():  # EOS ends the walk; advancing past it raises
            return True
        m.advance(token, return_tokens=False)
        return True


ADAPTERS = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines_core": OutlinesCore}


def allowed(bitmask, token: int) -> bool:
    return bool((int(bitmask[0, token >> 5]) >> (token & 31)) & 1)


def walk(lib, template, tokens: list[int], n_words: int):
    """One forced decode: per step (mask ms, consume ms); the index of the first token the
    mask or the matcher refused, or None."""
    import numpy as np

    m = lib.matcher(template)
    bitmask = np.zeros((1, n_words), dtype=np.int32)
    times = []
    for i, tok in enumerate(tokens):
        t0 = time.perf_counter()
        lib.fill(m, bitmask)
        t1 = time.perf_counter()
        if not allowed(bitmask, tok):
            return times, i
        try:
            ok = lib.consume(m, tok)
        except Exception:  # outlines-core raises on a refused token
            ok = False
        t2 = time.perf_counter()
        if not ok:
            return times, i
        times.append((1e3 * (t1 - t0), 1e3 * (t2 - t1)))
    return times, None


def measure_grammar(lib, ctx, schema, instance, hf, eos: int, repeats: int) -> dict:
    row: dict = {}
    rss0 = rss_mb()
    compile_s, kept = [], []
    while len(compile_s) < repeats and sum(compile_s) < COMPILE_BUDGET_S:
        t = time.perf_counter()
        kept.append(lib.compile(ctx, schema))
        compile_s.append(time.perf_counter() - t)
    row["compile_ms"] = 1e3 * statistics.median(compile_s)
    row["compile_repeats"] = len(compile_s)
    row["rss_mb"] = (rss_mb() - rss0) / len(kept)
    template = kept[0]
    del kept[1:]
    text = json.dumps(instance, ensure_ascii=False)
    tokens = hf.encode(text, add_special_tokens=False) + [eos]
    row["n_tokens"] = len(tokens)
    n_words = (len(hf) + 31) // 32
    first, steps, refused = [], [], None
    for _ in range(repeats):
        times, refused = walk(lib, template, tokens, n_words)
        if refused is not None:
            break
        first.append(times[0][0])
        steps.append(times[1:])
    row["ok"] = refused is None
    if refused is not None:
        row["refused_at"] = refused
        row["refused_text"] = hf.decode(tokens[max(0, refused - 3):refused + 1])
        return row
    mask = [statistics.median(s[i][0] for s in steps) for i in range(len(steps[0]))]
    step = [statistics.median(s[i][0] + s[i][1] for s in steps) for i in range(len(steps[0]))]
    row.update(first_mask_ms=statistics.median(first), mask_ms_median=statistics.median(mask),
               mask_ms_p95=pct(mask, 0.95), step_ms_median=statistics.median(step), step_ms_p95=pct(step, 0.95),
               step_ms_max=max(step))
    return row


def measure_processor(wrapper, schema, instance, repeats: int) -> dict:
    """Edge0's own processor (edge0/constrain.py, llguidance) end to end per token: feed the
    sampled token, compute the mask, apply it to [1, V] logits and evaluate them."""
    import mlx.core as mx

    from edge0.constrain import compile_response_format

    fmt = ({"type": "json_object"} if schema == {"type": "object"}
           else {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}})
    t = time.perf_counter()
    constraint = compile_response_format(fmt, wrapper)
    compile_ms = 1e3 * (time.perf_counter() - t)
    hf = wrapper._tokenizer
    tokens = hf.encode(json.dumps(instance, ensure_ascii=False), add_special_tokens=False)
    logits = mx.zeros((1, len(hf)))
    mx.eval(logits)
    runs = []
    for _ in range(repeats):
        proc, seq, times = constraint.processor(), [1, 2, 3], []
        for tok in [None] + tokens:
            if tok is not None:
                seq.append(tok)
            arr = mx.array(seq)
            t = time.perf_counter()
            mx.eval(proc(arr, logits))
            times.append(1e3 * (time.perf_counter() - t))
        runs.append(times[1:])
    per = [statistics.median(r[i] for r in runs) for i in range(len(runs[0]))]
    return {"compile_ms": compile_ms, "call_ms_median": statistics.median(per), "call_ms_p95": pct(per, 0.95)}


def worker(lib_name: str, tok_dir: str, repeats: int) -> dict:
    from importlib.metadata import version

    from mlx_lm.utils import load_tokenizer

    wrapper = load_tokenizer(Path(tok_dir))
    hf = wrapper._tokenizer
    eos = sorted(wrapper.eos_token_ids)[0]
    out = {"lib": lib_name, "version": version(DIST[lib_name]), "vocab": len(hf)}
    t = time.perf_counter()
    lib = ADAPTERS[lib_name]()
    out["import_s"] = time.perf_counter() - t
    rss0 = rss_mb()
    setup_s = []
    for _ in range(min(3, repeats)):
        t = time.perf_counter()
        ctx = lib.setup(hf, eos)
        setup_s.append(time.perf_counter() - t)
    out["setup_ms"] = 1e3 * statistics.median(setup_s)
    out["setup_rss_mb"] = rss_mb() - rss0
    out["grammars"] = {}
    for name, (schema, instance) in GRAMMARS.items():
        try:
            out["grammars"][name] = measure_grammar(lib, ctx, schema, instance, hf, eos, repeats)
        except Exception as e:  # a library that cannot compile the grammar
            out["grammars"][name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    if lib_name == "llguidance":
        out["edge0_processor"] = {name: measure_processor(wrapper, schema, instance, repeats)
                                  for name, (schema, instance) in GRAMMARS.items()}
    return out


def stdlib_tokenizer(vocab: int, cache_dir: Path) -> Path:
    """A byte-level BPE of ``vocab`` tokens trained on the top-level stdlib sources (cached)."""
    import sysconfig

    from edge0.tiny.tokenizer import CHAT_TEMPLATE, train_tokenizer, write_tokenizer

    out = cache_dir / f"stdlib-bpe-{vocab}"
    if not (out / "tokenizer.json").exists():
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py"))]
        print(f"training a {vocab}-token byte-level BPE on {len(texts)} stdlib files ...", file=sys.stderr)
        write_tokenizer(train_tokenizer(texts, vocab).to_str(), out, chat_template=CHAT_TEMPLATE)
    return out


def run_worker(lib: str, tok_dir: Path, repeats: int, threads: int, timeout: float) -> dict:
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, __file__, "--worker", lib, "--tokenizer", str(tok_dir), "--repeats", str(repeats)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"lib": lib, "error": f"timed out after {timeout:.0f} s"}
    if p.returncode != 0:
        return {"lib": lib, "error": (p.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def fmt(x, nd=3) -> str:
    return "—" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def print_tables(results: list[dict]) -> None:
    print("| library | version | tokenizer | import s | setup ms | setup RSS MiB |")
    print("|---|---|---|---:|---:|---:|")
    for r in results:
        if "error" in r:
            print(f"| {r['lib']} | — | {r['tokenizer']} | error: {r['error']} | | |")
            continue
        print(f"| {r['lib']} | {r['version']} | {r['tokenizer']} | {fmt(r['import_s'], 2)} | {fmt(r['setup_ms'], 1)} "
              f"| {fmt(r['setup_rss_mb'], 1)} |")
    print()
    print("| library | tokenizer | grammar | compile ms | first mask ms | mask ms median | step ms median "
          "| step ms p95 | step ms max | tokens | ok | compile RSS MiB |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in results:
        for name, g in r.get("grammars", {}).items():
            ok = "yes" if g.get("ok") else ("no: " + (g.get("error") or f"refused token {g.get('refused_at')} "
                                                                        f"{g.get('refused_text')!r}"))
            print(f"| {r['lib']} | {r['tokenizer']} | {name} | {fmt(g.get('compile_ms'), 1)} "
                  f"| {fmt(g.get('first_mask_ms'))} | {fmt(g.get('mask_ms_median'))} | {fmt(g.get('step_ms_median'))} "
                  f"| {fmt(g.get('step_ms_p95'))} | {fmt(g.get('step_ms_max'))} | {fmt(g.get('n_tokens'))} | {ok} "
                  f"| {fmt(g.get('rss_mb'), 1)} |")


def print_processor(results: list[dict]) -> None:
    rows = [(r["tokenizer"], name, p) for r in results for name, p in r.get("edge0_processor", {}).items()]
    if not rows:
        return
    print("\nedge0.constrain (llguidance) end to end: compile_response_format (the first compile per tokenizer "
          "includes its setup, cached after), and one processor call per token (feed the token, mask, apply to "
          "[1, V] logits, evaluate):\n")
    print("| tokenizer | grammar | compile ms | call ms median | call ms p95 |")
    print("|---|---|---:|---:|---:|")
    for tok, name, p in rows:
        print(f"| {tok} | {name} | {fmt(p['compile_ms'], 1)} | {fmt(p['call_ms_median'])} | {fmt(p['call_ms_p95'])} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--libs", default=",".join(LIBS))
    p.add_argument("--vocab", default="32768", help="sizes of the stdlib BPEs, comma-separated (0: demo tokenizer only)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per library and tokenizer")
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "edge0-constrained-cost")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.tokenizer, a.repeats)))
        return
    import edge0

    toks = {"demo (2048)": Path(edge0.__file__).parent / "data" / "demo_model"}
    for vocab in (int(v) for v in a.vocab.split(",") if int(v)):
        toks[f"stdlib BPE ({vocab})"] = stdlib_tokenizer(vocab, a.cache_dir)
    results = []
    for lib in a.libs.split(","):
        for label, tok_dir in toks.items():
            print(f"{lib} on {label} ...", file=sys.stderr)
            r = run_worker(lib, tok_dir, a.repeats, a.threads, a.timeout)
            r["tokenizer"] = label
            results.append(r)
    print(f"Median of {a.repeats} repeats (compiles: fewer once they took {COMPILE_BUDGET_S:.0f} s), "
          f"{a.threads} thread(s); step = mask + consume.\n")
    print_tables(results)
    print_processor(results)
    if a.out:
        a.out.write_text(json.dumps({"repeats": a.repeats, "threads": a.threads, "results": results}, indent=2))


if __name__ == "__main__":
    main()
