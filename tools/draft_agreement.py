"""How often a draft model's greedy drafts are what the model decodes, without any pause:
the model's greedy continuation of each bench text (the engine's default configuration),
then the draft model teacher-forced on it (its greedy token at each position); a draft of
k tokens from position t is taken up to its first miss, so the tokens a verify pass would
make there are the run of agreements from t (at most k) plus one. Prints, per text, the
share of positions where the draft's token is the model's and the tokens a pass would make
at k drafts, drafting at every step; with --out, the figures as JSON.

    python tools/draft_agreement.py --draft-model DIR [--model DIR] [--max-tokens 128] [--k 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prompt_lookup_bench import CASES  # noqa: E402

from edge0 import Engine, EngineConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft-model", required=True)
    ap.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3, help="tokens a draft holds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.model is None:
        from edge0.cli_args import PACKAGED_DEMO

        args.model = str(PACKAGED_DEMO)
    rows = []
    from edge0.backend import core as B
    from edge0.draft_model import DraftModel

    with Engine(args.model, EngineConfig(log_level="error")) as e:
        draft = DraftModel(args.draft_model, e.tokenizer)

        def agreement(ids: list[int], out: list[int]) -> list[bool]:
            logits = draft.model(B.array([ids + out[:-1]]))[0, len(ids) - 1:]
            return [a == b for a, b in zip(B.to_host(logits.argmax(axis=-1)).tolist(), out)]

        for case, (prompt, _) in CASES.items():  # greedy: what a draft is checked against at temperature 0
            ids = e.encode(prompt)
            out = [ev.token for ev in e.stream(ids, max_tokens=args.max_tokens)]
            agree = agreement(ids, out)
            made = []
            for t in range(len(agree)):
                run = 0
                while run < args.k and t + run < len(agree) and agree[t + run]:
                    run += 1
                made.append(run + 1)
            rows.append({"case": case, "agreement": sum(agree) / len(agree), "tokens_a_pass": sum(made) / len(made)})
    print(f"| text (greedy) | the draft's token is the model's | tokens a pass at {args.k} drafts, drafting every step |")
    print("|---|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['agreement']:.0%} | {r['tokens_a_pass']:.2f} |")
    if args.out:
        named = {"model": Path(args.model).name, "draft_model": Path(args.draft_model).name}
        Path(args.out).write_text(json.dumps({"args": {**vars(args), **named}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
