"""Incremental detokenization: token ids in, finished text out.

Each step decodes only a short window of ids with the real tokenizer decoder
and emits the text that window adds, so the concatenated output equals one
full ``decode`` of the sequence. Text is held back while the bytes so far end
in an incomplete UTF-8 character (a byte-level or ``<0xXX>`` token may carry
part of one). A byte-fallback decoder turns every byte of a run of ``<0xXX>``
tokens into U+FFFD when the run as a whole is not valid UTF-8, so such runs are
held until a token of another kind ends them. Once text has been emitted, the window is decoded behind a fixed
anchor token, so decoders that strip a leading space at the start of the
output (SentencePiece) strip it only at the real start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


def _incomplete_utf8_tail(tail: bytes) -> bool:
    """True if ``tail`` ends in the first bytes of a multi-byte UTF-8 char."""
    for back in range(1, min(4, len(tail)) + 1):
        b = tail[-back]
        if b & 0xC0 == 0x80:  # continuation byte: keep looking for the lead
            continue
        if 0xC0 <= b < 0xE0:
            need = 2
        elif 0xE0 <= b < 0xF0:
            need = 3
        elif 0xF0 <= b < 0xF8:
            need = 4
        else:
            return False
        return back < need
    return False


class IncrementalDetokenizer:
    """Streams text for one sequence; create a new one per sequence.

    ``add(token_id)`` returns the text that became final with this token (often
    ``""``); ``flush()`` returns whatever is still held at the end.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._anchor = tokenizer._anchor_id
        self._anchor_text = tokenizer._anchor_text
        self._window: list[int] = []  # context tokens + pending tokens
        self._n_context = 0  # how many leading window tokens are already emitted
        self._context_text = ""
        self._started = False  # has any text been emitted for this sequence
        self._tail = b""  # last bytes of the token stream, for UTF-8 completeness
        self._in_byte_run = False

    def _decode(self, ids: list[int]) -> str:
        if not self._started or self._anchor is None:
            return self._tok.decode(ids, skip_special_tokens=self._skip)
        text = self._tok.decode([self._anchor, *ids], skip_special_tokens=self._skip)
        return text[len(self._anchor_text):]

    def add(self, token_id: int) -> str:
        token_id = int(token_id)
        self._window.append(token_id)
        if not (self._skip and self._tok.is_special(token_id)):
            self._tail = (self._tail + self._tok.token_bytes(token_id))[-3:]
            self._in_byte_run = self._tok.is_byte_fallback(token_id)
        if self._in_byte_run or _incomplete_utf8_tail(self._tail):
            return ""
        text = self._decode(self._window)
        pending = len(self._window) - self._n_context
        # A decoder we cannot see bytes for may still end in U+FFFD mid-character;
        # a character never spans more than four tokens.
        if text.endswith(_REPLACEMENT) and pending < 4:
            return ""
        return self._emit(text)

    def _emit(self, text: str) -> str:
        delta = text[len(self._context_text):] if text.startswith(self._context_text) else text
        if delta:
            # The tokens just emitted become the next window's context.
            self._window = self._window[self._n_context:]
            self._started = True
            self._n_context = len(self._window)
            self._context_text = self._decode(self._window)
        else:
            # Nothing visible yet (e.g. a skipped special token): keep the older
            # context so the next decode still sees real preceding text.
            self._n_context = len(self._window)
            self._context_text = text
        return delta

    def flush(self) -> str:
        """Return all text still held (a trailing partial character decodes as U+FFFD)."""
        if len(self._window) == self._n_context:
            return ""
        delta = self._emit(self._decode(self._window))
        self._tail = b""
        self._in_byte_run = False
        return delta
