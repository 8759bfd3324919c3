"""The tokenizer of tiny checkpoints: a byte-level BPE trained offline, in about 0.1 s, on a
fixed list of Python standard-library sources (with a built-in fallback text), cached per
process; ``<|endoftext|>`` is id 0. Its tokenizer_config carries a ChatML-style chat
template, so that tiny models exercise chat-template handling as instruct models do."""

from __future__ import annotations

import json
import os
import sysconfig
import threading
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
EOS_TOKEN_ID = 0  # the trainer puts special tokens first
DEFAULT_VOCAB = 512

_CORPUS_MODULES = (
    "textwrap",
    "string",
    "bisect",
    "heapq",
    "colorsys",
    "fnmatch",
    "keyword",
    "functools",
    "abc",
    "copy",
    "pprint",
    "dataclasses",
    "enum",
    "types",
    "contextlib",
    "operator",
    "shlex",
    "glob",
    "posixpath",
)

_FALLBACK_TEXT = '''\
def f(x):
    """Return x plus one."""
    return x + 1


class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def __repr__(self):
        return f"Point({self.x!r}, {self.y!r})"


for i in range(10):
    if i % 2 == 0:
        print("even", i)
    else:
        print("odd", i)
'''

_tok_lock = threading.Lock()
_tok_cache: dict[int, str] = {}


def _corpus() -> list[str]:
    import keyword

    texts = []
    stdlib = sysconfig.get_paths().get("stdlib", "")
    for name in _CORPUS_MODULES:
        path = os.path.join(stdlib, name + ".py")
        try:
            with open(path, encoding="utf-8") as fh:
                texts.append(fh.read())
        except OSError:
            continue
    texts.append(_FALLBACK_TEXT)
    texts.append(" ".join(keyword.kwlist))
    return texts


def train_tokenizer(texts, vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` with at most ``vocab_size`` tokens and
    ``<|endoftext|>`` as id 0, trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    if tok.token_to_id(EOS_TOKEN) != EOS_TOKEN_ID:
        raise RuntimeError(f"tokenizer: {EOS_TOKEN} did not get id {EOS_TOKEN_ID}")
    if tok.get_vocab_size() > vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens > vocab_size {vocab_size}")
    return tok


def _tokenizer_json(vocab_size: int) -> str:
    with _tok_lock:
        cached = _tok_cache.get(vocab_size)
        if cached is None:
            cached = _tok_cache[vocab_size] = train_tokenizer(_corpus(), vocab_size).to_str()
        return cached


# A ChatML-style template, so that tiny models exercise chat-template handling as instruct
# models do (the role markers are plain text to this tokenizer).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out_dir, *, vocab_size: int = DEFAULT_VOCAB) -> None:
    """Write a byte-level BPE ``tokenizer.json`` (at most ``vocab_size`` tokens,
    EOS ``<|endoftext|>`` = id 0), ``tokenizer_config.json`` (with a chat template) and
    ``special_tokens_map.json`` into ``out_dir``."""
    if not isinstance(vocab_size, int) or vocab_size < 300:
        raise ValueError(f"vocab_size={vocab_size!r} must be an int >= 300")
    write_tokenizer(_tokenizer_json(vocab_size), out_dir, chat_template=CHAT_TEMPLATE)


def write_tokenizer(tokenizer_json: str, out_dir, chat_template: str | None = None) -> None:
    """``tokenizer.json`` plus the two small config files mlx-lm's loader reads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    if chat_template is not None:
        tok_cfg["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2), encoding="utf-8")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}, indent=2), encoding="utf-8")
