"""A prompt cache file's layout, checked before mlx-lm builds anything from it.

mlx-lm's ``save_prompt_cache`` writes the layers' states as tensors and three lists as
metadata, each flattened with ``tree_flatten`` (dotted names, list elements numbered):

    tensors          "<layer>.<element>[.<element>...]"  (the state of each layer's cache)
    "0.<name>"       the caller's metadata (``mlx_lm.cache_prompt``: the model, ...)
    "1.<layer>"      each layer's cache class, e.g. "KVCache"
    "2.0"            a placeholder (it keeps the list from being empty)
    "2.<n>.0"        a tensor that stands for a state value that is not an array ...
    "2.<n>.1"        ... and what the value was: "scalar", "string" or "none"

``load_prompt_cache`` rebuilds these trees with ``tree_unflatten``, which makes a list of
every level whose names all read as integers, as long as the largest of them: one key
naming element 50,000,000 costs gigabytes before anything fails. So the header is read
strictly here first, and every index is held to what the file itself holds: a plain
decimal number (``int()`` also reads "01", "-1", " 1", "1_0"), layers below the number
the file has, each level's elements below their count (``tree_flatten`` numbers every
element, so a level has no gaps), class names that mlx-lm's cache module defines (it
looks them up by name). Anything else is a ``ConfigError`` naming the file and the key.
"""

from __future__ import annotations

import re
from collections import defaultdict

from edge0.errors import ConfigError, HeaderError
from edge0.model.safetensors_header import read_header

# Deeper than any cache state nests (a CacheList of quantized caches: 5); tree_unflatten
# copies the rest of a key once per level, so a deep key costs its length times its depth.
MAX_DEPTH = 16
SCALAR_KINDS = ("scalar", "string", "none")
_MAX_INDEX_DIGITS = 18  # more than any file holds; keeps int() off hostile digit strings
_INT_TEXT = re.compile(r"\s*[+-]?\d+(?:_\d+)*\s*")  # int()'s grammar (Unicode digits and spaces too)


def check_cache_file(path, class_names) -> None:
    """Raise ``ConfigError`` unless the file at ``path`` is laid out as
    ``save_prompt_cache`` writes it, with only ``class_names`` as layer classes."""
    try:
        header = read_header(path)
    except HeaderError as e:
        where = f"tensor {e.tensor!r}: " if e.tensor is not None else ""
        raise ConfigError(f"prompt cache file {path} is not an mlx-lm prompt cache (mlx_lm.cache_prompt writes "
                          f"one): {where}{e.reason}") from None

    def fail(message: str) -> ConfigError:
        return ConfigError(f"prompt cache file {path}: {message}")

    tensors = {name: _indices(name, fail) for name in header.tensors}
    user, classes, records = _sections(header.metadata, fail)
    if not tensors and not classes:
        raise ConfigError(f"prompt cache file {path} holds no cache")
    layers = {parts[0] for parts in tensors.values()}
    for name, parts in tensors.items():
        if parts[0] >= len(classes):
            raise fail(f"tensor name {_show(name)} names layer {_show_index(name, 0)}, but the file names the "
                       f"cache class of {len(classes)} layers")
    for key, (layer, cls) in classes.items():
        if layer >= len(layers):
            raise fail(f"metadata key {_show(key)} names layer {_show_index(key, 1)}, but the file's tensors hold "
                       f"{len(layers)} layers")
        if cls not in class_names:
            raise fail(f"metadata key {_show(key)} names the cache class {_show(cls)}, which mlx-lm's cache "
                       "module does not define")
    _check_levels(tensors, fail)
    _check_records(records, header.tensors, fail)
    _check_user(user, fail)


def _show(text: str) -> str:
    return repr(text) if len(text) <= 80 else f"{text[:60]!r}... ({len(text)} characters)"


def _show_index(key: str, at: int) -> str:
    part = key.split(".")[at]
    return part if len(part) <= 24 else f"{part[:20]}... ({len(part)} digits)"


def _index(part: str) -> int | None:
    """A plain decimal index (no sign, space, underscore or leading zero), else None;
    a longer one than any file holds reads as 10**18."""
    if not (part.isascii() and part.isdigit()) or (part[0] == "0" and part != "0"):
        return None
    return int(part) if len(part) <= _MAX_INDEX_DIGITS else 10**_MAX_INDEX_DIGITS


def _split(key: str, what: str, fail) -> list[str]:
    parts = key.split(".", MAX_DEPTH)
    if len(parts) > MAX_DEPTH:
        raise fail(f"{what} {_show(key)} has more than {MAX_DEPTH} dotted parts; no cache state nests that deep")
    return parts


def _indices(name: str, fail) -> tuple[int, ...]:
    parts = _split(name, "tensor name", fail)
    if len(parts) < 2:
        raise fail(f"tensor name {_show(name)} is not '<layer>.<state element>'")
    out = []
    for part in parts:
        i = _index(part)
        if i is None:
            raise fail(f"tensor name {_show(name)}: {_show(part)} is not an index (a plain decimal number)")
        out.append(i)
    return tuple(out)


def _sections(metadata: dict, fail) -> tuple[dict, dict, dict]:
    """The metadata as (the caller's: key -> its parts after "0"), (classes: key -> (layer,
    class name)) and (records: key -> (n, 0 or 1, value)), every index checked."""
    user, classes, records = {}, {}, {}
    for key, value in metadata.items():
        parts = _split(key, "metadata key", fail)
        head, rest = parts[0], parts[1:]
        if head == "0" and rest:
            user[key] = rest
            continue
        if head == "1" and len(rest) == 1:
            layer = _index(rest[0])
            if layer is None:
                raise fail(f"metadata key {_show(key)}: {_show(rest[0])} is not a layer index (a plain decimal "
                           "number)")
            classes[key] = (layer, value)
            continue
        if head == "2" and rest == ["0"]:
            records[key] = (0, 0, value)
            continue
        if head == "2" and len(rest) == 2 and rest[1] in ("0", "1"):
            n = _index(rest[0])
            if n is None or n == 0:
                raise fail(f"metadata key {_show(key)}: {_show(rest[0])} is not a record number (a plain decimal "
                           "number from 1)")
            records[key] = (n, int(rest[1]), value)
            continue
        raise fail(f"metadata key {_show(key)} is none that save_prompt_cache writes ('0.<name>', '1.<layer>', "
                   "'2.0', '2.<n>.0', '2.<n>.1')")
    return user, classes, records


def _check_levels(tensors: dict[str, tuple[int, ...]], fail) -> None:
    """Below each layer, every level's elements are numbered 0..count-1, and a tensor is
    never also the start of another's name."""
    children: dict[tuple, set[int]] = defaultdict(set)
    for parts in tensors.values():
        for d in range(1, len(parts)):
            children[parts[:d]].add(parts[d])
    for name, parts in tensors.items():
        if parts in children:
            raise fail(f"tensor name {_show(name)} holds a value and is also the start of other tensors' names")
        for d in range(1, len(parts)):
            count = len(children[parts[:d]])
            if parts[d] >= count:
                where = f"layer {parts[0]}'s state" if d == 1 else f"'{'.'.join(map(str, parts[:d]))}'"
                raise fail(f"tensor name {_show(name)} names element {_show_index(name, d)} of {where}, which has "
                           f"{count} elements in this file")


def _check_records(records: dict, tensors: dict, fail) -> None:
    """"2.0", then records 1..count-1, each naming a tensor of the file and its kind."""
    if not any(n == 0 for n, _, _ in records.values()):
        raise fail("metadata key '2.0' is missing (save_prompt_cache always writes it)")
    fields: dict[int, set[int]] = defaultdict(set)
    for n, field, _ in records.values():
        fields[n].add(field)
    for key, (n, field, value) in records.items():
        if n >= len(fields):
            raise fail(f"metadata key {_show(key)} names record {_show_index(key, 1)}, but the file holds "
                       f"{len(fields)} records ('2.0' and '2.<n>.0' / '2.<n>.1')")
        if n and fields[n] != {0, 1}:
            raise fail(f"metadata key {_show(key)} has no partner '2.{n}.{1 - field}'")
        if n and field == 0 and value not in tensors:
            raise fail(f"metadata key {_show(key)} names the tensor {_show(value)}, which the file does not hold")
        if n and field == 1 and value not in SCALAR_KINDS:
            raise fail(f"metadata key {_show(key)}: {_show(value)} is none of {', '.join(SCALAR_KINDS)}")


def _check_user(user: dict[str, list[str]], fail) -> None:
    """The caller's metadata names anything, but a name ``int()`` reads is a list index to
    ``tree_unflatten``: it must be plain and below the number of names at its level."""
    children: dict[tuple, set[str]] = defaultdict(set)
    for rest in user.values():
        for d in range(len(rest)):
            children[tuple(rest[:d])].add(rest[d])
    for key, rest in user.items():
        for d, part in enumerate(rest):
            if not _reads_as_int(part):
                continue
            count = len(children[tuple(rest[:d])])
            i = _index(part)
            if i is None or i >= count:
                raise fail(f"metadata key {_show(key)}: {_show(part)} reads as a list index, which must be a plain "
                           f"decimal number below {count} (the names at its level)")


def _reads_as_int(part: str) -> bool:
    """Whether ``int()`` (what tree_unflatten tries) reads ``part``; a long one by the same
    grammar, since int() of a long digit string is slow where its length limit is lifted."""
    if len(part) > 64:
        return _INT_TEXT.fullmatch(part) is not None
    try:
        int(part)
    except ValueError:
        return False
    return True
