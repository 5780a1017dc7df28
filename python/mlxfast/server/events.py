"""The typed output events every API serialises in its own wire format."""

from __future__ import annotations

from dataclasses import dataclass

from ..text.tool_calls import ToolCallArgs, ToolCallEnd, ToolCallStart

__all__ = ["ContentDelta", "ReasoningDelta", "ToolCallStart", "ToolCallArgs", "ToolCallEnd", "TOOL_EVENTS"]


@dataclass
class ContentDelta:
    text: str


@dataclass
class ReasoningDelta:
    text: str


# ToolCallStart(index, name), ToolCallArgs(index, text): the next piece of
# the arguments' JSON as the model writes it, ToolCallEnd(index).
TOOL_EVENTS = (ToolCallStart, ToolCallArgs, ToolCallEnd)
