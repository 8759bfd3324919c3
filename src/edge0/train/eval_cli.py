"""Held-out quality of a checkpoint, optionally against its teacher.

    edge0 eval --model DIR [--teacher DIR] --data HELDOUT [--max-tokens N]
        [--seq-len L] [--batch-size B] [--unigram COUNTS.npy] [--routing] [--json OUT]

HELDOUT is a ``.npy`` file of token ids (``heldout_tokens.npy`` written by
``tools/train_teacher.py``) or a text file (encoded with the model's tokenizer).
Prints the model's perplexity; with ``--teacher`` also the teacher's, the top-1 agreement
and the mean KL(teacher || model) per token; the add-one unigram baseline when train
counts are found (``--unigram``, default ``train_unigram_counts.npy`` beside HELDOUT);
with ``--routing`` the per-layer expert load (entropy / log E, max-load share) of each
model.  Models run with mlx-lm's resident classes in float32 activations.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    from edge0.cli_args import Parser

    p = Parser(prog="edge0 eval", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint directory to evaluate (mlx-lm layout)")
    p.add_argument("--teacher", default=None, help="reference checkpoint (same tokenizer) for agreement and KL")
    p.add_argument("--data", required=True, help="held-out token ids (.npy) or text file")
    p.add_argument("--max-tokens", type=int, default=None, help="evaluate at most N predicted tokens")
    p.add_argument("--seq-len", type=int, default=None,
                   help="window length (default: the training seq_len from provenance.json, else 256)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--unigram", default=None,
                   help="train-set token counts (.npy); default train_unigram_counts.npy beside --data")
    p.add_argument("--routing", action="store_true", help="also report per-layer expert load")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    a = p.parse_args(argv)
    if a.max_tokens is not None and a.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    if a.batch_size < 1:
        p.error("--batch-size must be >= 1")

    import numpy as np

    from edge0.train import evaluate as ev
    from edge0.train.teacher import UNIGRAM_FILE

    try:
        model, tokenizer = ev.load_model(a.model)
        teacher = ev.load_model(a.teacher)[0] if a.teacher else None
        tokens = ev.load_tokens(a.data, tokenizer)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seq_len = a.seq_len or ev.default_seq_len(a.teacher or a.model)
    vocab = int(model.args.vocab_size) if hasattr(model, "args") else None
    if vocab is not None and tokens.size and int(tokens.max()) >= vocab:
        print(f"error: {a.data} has token id {int(tokens.max())} >= the model's vocab_size {vocab}", file=sys.stderr)
        return 2

    out: dict = {"model": a.model, "teacher": a.teacher, "data": a.data, "seq_len": seq_len,
                 "max_tokens": a.max_tokens}
    t0 = time.perf_counter()
    res = ev.evaluate_tokens(model, tokens, teacher=teacher, seq_len=seq_len, max_tokens=a.max_tokens,
                             batch_size=a.batch_size)
    out["eval"] = res.to_dict()
    out["eval_seconds"] = round(time.perf_counter() - t0, 2)
    print(f"data: {a.data}: {res.n_tokens:,} predicted tokens in windows of {seq_len} ({out['eval_seconds']} s)")
    print(f"model   {a.model}: nll {res.nll:.4f} nats/token, perplexity {res.perplexity:.3f}")
    if teacher is not None:
        print(f"teacher {a.teacher}: nll {res.teacher_nll:.4f} nats/token, perplexity {res.teacher_perplexity:.3f}")
        print(f"model vs teacher: top-1 agreement {res.top1_agreement:.4f}, "
              f"mean KL(teacher || model) {res.kl:.5f} nats/token")

    counts_path = Path(a.unigram) if a.unigram else Path(a.data).with_name(UNIGRAM_FILE)
    if counts_path.exists():
        counts = np.load(counts_path, allow_pickle=False)
        uni = ev.unigram_perplexity(counts, tokens, vocab_size=vocab, seq_len=seq_len, max_tokens=a.max_tokens)
        out["unigram"] = {**uni.to_dict(), "counts": str(counts_path)}
        print(f"unigram baseline ({counts_path.name}, add-one): nll {uni.nll:.4f} nats/token, "
              f"perplexity {uni.perplexity:.3f}")
    elif a.unigram:
        print(f"error: --unigram {a.unigram} does not exist", file=sys.stderr)
        return 2

    if a.routing:
        out["routing"] = {}
        for name, m in (("model", model), ("teacher", teacher)):
            if m is None:
                continue
            loads = ev.routing_load(m, tokens, seq_len=seq_len, max_tokens=a.max_tokens, batch_size=a.batch_size)
            out["routing"][name] = [ld.to_dict() for ld in loads]
            print(f"\nrouting load ({name}: {a.model if name == 'model' else a.teacher}):")
            print(ev.format_loads(loads))

    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
