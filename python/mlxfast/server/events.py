"""The typed output events every API serialises in its own wire format."""

from __future__ import annotations

from dataclasses import dataclass

from ..text.tool_calls import ToolCallArgs, ToolCallEnd, ToolCallStart

__all__ = ["ContentDelta", "ReasoningDelta", "ToolCallStart", "ToolCallArgs", "ToolCallEnd"]


@dataclass
class ContentDelta:
    text: str


@dataclass
class ReasoningDelta:
    text: str


# And the tool-call events of text/tool_calls.py: ToolCallStart(index, name),
# ToolCallArgs(index, text) (the next piece of the arguments' JSON as the
# model writes it), ToolCallEnd(index).
