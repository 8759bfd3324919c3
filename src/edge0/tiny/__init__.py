"""Small random int4 MoE checkpoints in the exact layout mlx-lm saves, for every
architecture Edge0 streams (:data:`ARCHITECTURES`).

- :mod:`edge0.tiny.configs`: ``tiny_config``, a complete config.json per model type;
- :mod:`edge0.tiny.build`: ``make_tiny``, the checkpoint itself (mlx-lm's own model
  class, random weights with spread routing, int4 as ``mlx_lm.convert -q`` writes it);
- :mod:`edge0.tiny.tokenizer`: the offline-trained byte-level BPE they ship with.
"""

from edge0.tiny.configs import ARCHITECTURES, BITS, CLASSIC, GROUP_SIZE, MIN_LAYERS, tiny_config
from edge0.tiny.tokenizer import (
    CHAT_TEMPLATE,
    DEFAULT_VOCAB,
    EOS_TOKEN,
    EOS_TOKEN_ID,
    build_tokenizer,
    train_tokenizer,
    write_tokenizer,
)

def __getattr__(name: str):
    # the builder imports MLX; the configs and the tokenizer do not (the CLI lists
    # ARCHITECTURES before the array library loads)
    if name in ("make_tiny", "expert_usage"):
        from edge0.tiny import build

        return getattr(build, name)
    raise AttributeError(f"module 'edge0.tiny' has no attribute {name!r}")


# The six families Edge0 first supported (kept for their fixed test shapes).
FAMILIES = CLASSIC

__all__ = [
    "ARCHITECTURES", "BITS", "CHAT_TEMPLATE", "CLASSIC", "DEFAULT_VOCAB", "EOS_TOKEN", "EOS_TOKEN_ID", "FAMILIES",
    "GROUP_SIZE", "MIN_LAYERS", "build_tokenizer", "expert_usage", "make_tiny", "tiny_config", "train_tokenizer",
    "write_tokenizer",
]
