"""Text helpers of streamed output, free of the array library (the server's request
worker processes import them without MLX)."""

from __future__ import annotations


def open_tail(text: str, markers) -> int:
    """How many characters at the end of ``text`` begin one of ``markers`` without
    completing it: the part of a streamed text to hold back while it may still grow into
    a marker (a stop string, a tool call's start)."""
    keep = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), keep, -1):
            if text.endswith(m[:n]):
                keep = n
                break
    return keep
