"""Reusing the KV cache of an earlier generation whose tokens the new prompt extends.

The next turn of a chat is the previous prompt, the reply and the new message: with the
earlier generation's cache, only the new tokens need a prefill. Entries are per scope: the
adapter (an adapter changes the keys and values) and the caller's ``cache_scope`` (a
tenant: what one scope cached never shortens another's prefill, so its timing and its
``cached_tokens`` say nothing about another tenant's prompts). They are bounded in bytes and
evicted least recently used first.

A generation takes its entry out of the store (one owner: the cache is extended in place)
and puts the extended cache back when it ends, with the tokens it now covers. An entry
matches a prompt when its tokens are a prefix of it; the longest shared prefix wins. Of an
entry that goes past the point where the prompt diverges, the shared prefix is copied
and the entry stays, for the conversation it holds (another user's request between two
turns does not take it away); where its layers are not plain KV caches, the entry is
trimmed back to the common prefix when they allow trimming (state-space and
linear-attention states do not). At least the prompt's last token is always computed,
since its logits start the generation; with prerouter heads, its last three, so that the
heads observe the two tokens before the last as they would after a whole prefill (their
first prediction, and so the text, is then the same with the cache as without).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from edge0.backend import nn as bnn
from edge0.errors import ConfigError

MAX_CACHE_SCOPE = 1024  # characters


def check_scope(scope) -> None:
    """A generation's ``cache_scope``: None or a string of at most ``MAX_CACHE_SCOPE``
    characters."""
    if scope is not None and (not isinstance(scope, str) or len(scope) > MAX_CACHE_SCOPE):
        raise ConfigError(f"cache_scope must be None or a string of at most {MAX_CACHE_SCOPE} characters, got "
                          f"{type(scope).__name__} {str(scope)[:40]!r}")


class PromptCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, tuple[Hashable, tuple[int, ...], list, int]] = OrderedDict()
        self._next = 0
        self.hits = self.misses = 0

    @property
    def nbytes(self) -> int:
        return sum(e[3] for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, scope: Hashable, ids: list[int], compute: int = 1) -> tuple[list | None, int]:
        """(cache, tokens it already holds) for a prompt, removed from the store; (None, 0)
        when nothing reusable is stored. At least the prompt's last ``compute`` tokens are
        left to compute (prerouter heads must observe the two tokens before the last, as a
        whole prompt's prefill lets them)."""
        best, best_len = None, 0
        for key, (name, tokens, cache, _) in self._entries.items():
            if name != scope:
                continue
            common = _common_prefix(tokens, ids)
            usable = min(common, len(ids) - compute)
            if usable > best_len and (usable == len(tokens) or bnn.cache_trimmable(cache)):
                best, best_len = key, usable
        if best is None:
            self.misses += 1
            return None, 0
        name, tokens, cache, size = self._entries[best]
        if best_len < len(tokens):  # a shared prefix: copy it, the entry stays for whoever it holds
            copied = bnn.copy_prefix(cache, best_len)
            if copied is not None:
                self._entries.move_to_end(best)
                self.hits += 1
                return copied, best_len
        del self._entries[best]
        if not bnn.trim_cache(cache, len(tokens) - best_len):
            self.misses += 1
            return None, 0
        self.hits += 1
        return cache, best_len

    def put(self, scope: Hashable, tokens: list[int], cache: list, size: int | None = None) -> None:
        """Store ``cache``, which holds exactly ``tokens``; evict the least recently used
        entries beyond the byte bound (a cache larger than the bound is not kept). ``size``:
        the bytes to count it as (default: what it holds)."""
        size = bnn.cache_nbytes(cache) if size is None else size
        if size > self.max_bytes or not tokens:
            return
        self._entries[self._next] = (scope, tuple(tokens), cache, size)
        self._next += 1
        while self.nbytes > self.max_bytes:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n



def load_prompt_cache(path) -> list:
    """A prompt cache file that ``mlx_lm.cache_prompt`` wrote, as the cache
    ``Engine.stream(prompt, prompt_cache=...)`` continues (read on the calling thread; a
    file that is not one is a ``ConfigError`` naming it)."""
    return bnn.load_cache_file(path)[0]
