"""Recent responses of the Responses API, kept in memory so a client can
continue a conversation with ``previous_response_id`` or read one back.

Each entry holds its own turn only (the input it was given and the output it
made, as chat messages); a conversation is the chain of its entries, read
back through their ``previous_response_id``. The store keeps the most recent
``capacity`` entries: continuing a conversation marks its whole chain
recent, so a live conversation is not evicted from under its client.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class StoredResponse:
    response: dict  # the response object as returned
    messages: list[dict]  # this turn: its input, then its output, as chat messages
    input_items: list[dict]  # the input items as given (with ids), for /input_items
    previous_id: str | None


class ResponseStore:
    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, entry: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._entries[entry.response["id"]] = entry
            self._entries.move_to_end(entry.response["id"])
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None

    def history(self, response_id: str) -> list[dict] | None:
        """The conversation up to and including ``response_id`` as chat
        messages, oldest first; None unless the whole chain is stored."""
        with self._lock:
            chain, rid = [], response_id
            while rid is not None:
                entry = self._entries.get(rid)
                if entry is None:
                    return None
                chain.append(entry)
                rid = entry.previous_id
                if len(chain) > len(self._entries):  # a cycle cannot be made through the API; never loop
                    return None
            for entry in chain:
                self._entries.move_to_end(entry.response["id"])
        return [m for entry in reversed(chain) for m in entry.messages]

    def __len__(self) -> int:
        return len(self._entries)
