"""Per-request output processing: incremental detokenization and stop strings.

Text that could still turn into a stop string is held back, so no emitted
text ever contains a stop string or anything after it, including across token
boundaries. Stop and EOS tokens are not turned into text, nor (by default,
as in vLLM and llama.cpp's server) other special tokens but the markup the
output parsers read.
"""

from __future__ import annotations

from ..text.markers import held_suffix


class _NullDetok:
    def add(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""

    def hides(self, token_id: int) -> bool:
        return False


class OutputProcessor:
    """``min_tokens``: a stop string matches only where it ends in the text
    of a later token (vLLM's: none before it; one that began earlier counts);
    ``include_stop``: a matched stop string is the end of the text instead of
    being cut."""

    def __init__(self, tokenizer, stop: list[str] | None = None, min_tokens: int = 0,
                 include_stop: bool = False, skip_special_tokens: bool = False):
        self.detok = (tokenizer.detokenizer(skip_special_tokens=skip_special_tokens)
                      if tokenizer is not None else _NullDetok())
        self._tok = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.held = ""
        self.stop_string: str | None = None
        self.min_tokens, self.include_stop = min_tokens, include_stop
        self.n_tokens = 0
        self._released = 0  # characters given out so far (where ``held`` starts)
        self._boundary = 0 if min_tokens <= 0 else None  # matches end past this offset, once known

    def _match(self, buf: str) -> tuple[int, str] | None:
        """The earliest stop string in ``buf`` that ends past the boundary."""
        best = None
        after = self._boundary - self._released  # a match must end beyond this index of buf
        for s in self.stop:
            i = buf.find(s, max(0, after - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _release(self, text: str, final: bool) -> str:
        """Append text; return what can be emitted. Sets ``stop_string`` on a match."""
        if not self.stop:
            return text
        buf = self.held + text
        if self._boundary is None and self.n_tokens > self.min_tokens:
            self._boundary = self._released + len(self.held)  # this token's text starts here
        best = self._match(buf) if self._boundary is not None else None
        if best is not None:
            self.held = ""
            self.stop_string = best[1]
            return buf[:best[0] + (len(best[1]) if self.include_stop else 0)]
        if final:
            self.held = ""
            out = buf
        else:
            hold = held_suffix(buf, self.stop)
            self.held = buf[len(buf) - hold:] if hold else ""
            out = buf[:len(buf) - hold]
        self._released += len(out)
        return out

    def add(self, token_id: int) -> str:
        """Text this token made final ("" while held back). Check ``stop_string`` after."""
        self.n_tokens += 1
        out = self._release(self.detok.add(token_id), final=False)
        if self.stop and self.stop_string is None and self.detok.hides(token_id) \
                and self.n_tokens > self.min_tokens:
            # A stop string written as a special token's text still stops the
            # output there, though that text is left out of it.
            special = self._tok.id_to_token(token_id)
            hits = [(special.find(s), s) for s in self.stop if s in special]
            if hits:
                stop = min(hits)[1]
                out += self.held + self.detok.flush() + (stop if self.include_stop else "")
                self.held, self.stop_string = "", stop
        return out

    def finish(self) -> str:
        """Everything still held at the end (not after a stop string)."""
        if self.stop_string is not None:
            return ""
        return self._release(self.detok.flush(), final=True)
