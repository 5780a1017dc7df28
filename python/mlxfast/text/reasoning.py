"""Split ``<think>…</think>`` reasoning from the answer, streaming.

``ReasoningParser.feed(text)`` returns ``[(kind, text), ...]`` with kind
``"reasoning"`` or ``"content"``. The opening tag is recognised only at the
start of the output (after whitespace); a parser built with
``in_reasoning=True`` starts inside the block, for templates whose generation
prompt already ends with ``<think>`` (DeepSeek-R1, Qwen3 thinking). Tags are
never part of either text, and a partial tag at the end of a piece is held
back until the next piece decides it.
"""

from __future__ import annotations

from .markers import held_suffix

START = "<think>"
END = "</think>"


class ReasoningParser:
    def __init__(self, in_reasoning: bool = False):
        self._state = "reasoning" if in_reasoning else "start"  # start|reasoning|content
        self._buf = ""
        self._strip_next = in_reasoning  # drop the newline(s) right after <think>
        self._strip_content = False  # ... and right after </think>

    @property
    def in_reasoning(self) -> bool:
        return self._state == "reasoning"

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while True:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith(START):
                    self._buf = stripped[len(START):]
                    self._state = "reasoning"
                    self._strip_next = True
                    continue
                if START.startswith(stripped):  # still undecided (may be empty)
                    return out
                self._state = "content"
            if self._state == "content":
                if self._strip_content:
                    self._buf = self._buf.lstrip("\n")
                    if not self._buf:
                        return out
                    self._strip_content = False
                if self._buf:
                    out.append(("content", self._buf))
                self._buf = ""
                return out
            # reasoning
            if self._strip_next:
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    return out
                self._strip_next = False
            i = self._buf.find(END)
            if i >= 0:
                if i:
                    out.append(("reasoning", self._buf[:i]))
                self._buf = self._buf[i + len(END):]
                self._state = "content"
                self._strip_content = True
                continue
            keep = held_suffix(self._buf, (END,))
            emit = self._buf[: len(self._buf) - keep]
            if emit:
                out.append(("reasoning", emit))
            self._buf = self._buf[len(self._buf) - keep:]
            return out

    def finish(self) -> list[tuple[str, str]]:
        buf, self._buf = self._buf, ""
        if not buf:
            return []
        if self._state == "reasoning":
            return [("reasoning", buf)]
        return [("content", buf)]

    def parse(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a complete output."""
        parts = self.feed(text) + self.finish()
        return (
            "".join(t for k, t in parts if k == "reasoning"),
            "".join(t for k, t in parts if k == "content"),
        )


def template_supports_thinking(chat_template: str | None) -> bool:
    return bool(chat_template) and START in chat_template


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when the rendered prompt leaves the model inside a think block."""
    tail = prompt_text.rstrip()
    return tail.endswith(START)
