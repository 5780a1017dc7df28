"""Incremental detokenization: token ids in, finished text out.

Each step decodes only a short window of ids with the real tokenizer decoder
and emits the text that window adds, so the concatenated output equals one
full ``decode`` of the sequence, less a character the sequence ends inside.
Text is held back while the bytes so far end in an incomplete UTF-8 character
(a byte-level or ``<0xXX>`` token may carry part of one). A byte-fallback
decoder turns every byte of a run of ``<0xXX>`` tokens into U+FFFD when the
run as a whole is not valid UTF-8, so such runs are held until a token of
another kind ends them. Once text has been emitted, the window is decoded
behind a fixed anchor token, so decoders that strip a leading space at the
start of the output (SentencePiece) strip it only at the real start.
"""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


def _partial_char_len(tail: bytes) -> int:
    """How many of ``tail``'s last bytes begin a UTF-8 character that is not
    complete yet (0 when it ends on a character boundary or an invalid byte),
    by Python's decoder: the maximal-subpart rule the tokenizers' own lossy
    decoding follows."""
    if not tail or tail[-1] < 0x80:  # ends in ASCII (most tokens): a boundary
        return 0
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(tail, final=False)
    return len(decoder.getstate()[0])


def _incomplete_utf8_tail(tail: bytes) -> bool:
    """True if ``tail`` ends in the first bytes of a multi-byte UTF-8 char."""
    return _partial_char_len(tail) > 0


class IncrementalDetokenizer:
    """Streams text for one sequence; create a new one per sequence.

    ``add(token_id)`` returns the text that became final with this token (often
    ``""``); ``flush()`` returns whatever is still held at the end.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
        self._tok = tokenizer
        # Skipped tokens never enter the window: decoding without them is what
        # the tokenizer's own skip_special_tokens does.
        self._hidden = tokenizer.hidden_special_ids if skip_special_tokens else frozenset()
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
            return self._tok.decode(ids)
        text = self._tok.decode([self._anchor, *ids])
        return text[len(self._anchor_text):]

    def add(self, token_id: int) -> str:
        token_id = int(token_id)
        if token_id in self._hidden:
            return ""
        self._window.append(token_id)
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
            # Nothing visible yet (a token whose text is empty): keep the older
            # context so the next decode still sees real preceding text.
            self._n_context = len(self._window)
            self._context_text = text
        return delta

    def hides(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special token this stream leaves out."""
        return int(token_id) in self._hidden

    def flush(self) -> str:
        """Return all text still held, less a character the output stopped in
        the middle of (its bytes, as vLLM and llama.cpp's server drop them)."""
        if len(self._window) == self._n_context:
            return ""
        window, cut = self._window, _partial_char_len(self._tail)
        byte_tokens = window[len(window) - cut:] if cut else []
        if cut and len(window) - cut >= self._n_context and all(
                self._tok.is_byte_fallback(i) for i in byte_tokens):
            text = self._decode(window[:len(window) - cut])  # one token a byte: drop them
        else:
            text = self._decode(window)
            if cut and text.endswith(_REPLACEMENT):
                text = text[:-1]  # byte-level decoders write one U+FFFD for the partial tail
        delta = self._emit(text)
        self._tail = b""
        self._in_byte_run = False
        return delta
