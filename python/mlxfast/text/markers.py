"""Holding back text that may still become a marker (a tag, a stop string)
while a stream is cut into pieces at arbitrary points."""

from __future__ import annotations

from typing import Iterable


def held_suffix(buf: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of one
    of ``markers``: the text to hold back until the next piece decides it."""
    best = 0
    for marker in markers:
        for n in range(min(len(buf), len(marker) - 1), best, -1):
            if marker.startswith(buf[-n:]):
                best = n
                break
    return best
