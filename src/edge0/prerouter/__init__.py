"""The prerouter: heads that predict the next layer's routing one token ahead.

The head owned by MoE layer l sees, at token t, layer l's post-attention-norm hidden state
and the top-k one-hots of the experts layer l used at t and at t-1, and predicts layer
l+1's router logits at t+1. At decode those logits go through layer l+1's own routing
function and the result IS layer l+1's routing: the staged set equals the routed set.
"""

from edge0.prerouter.heads import PrerouterHeads, eligible_owners
from edge0.prerouter.files import HEADS_FILENAME, load_heads, save_heads

__all__ = ["HEADS_FILENAME", "PrerouterHeads", "eligible_owners", "load_heads", "save_heads"]
