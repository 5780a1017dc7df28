"""Recent responses of the Responses API, kept in memory so a client can
continue a conversation with ``previous_response_id`` or read one back.

Each entry holds its own turn only (the input it was given and the output it
made, as chat messages); a conversation is the chain of its entries, read
back through their ``previous_response_id``. The store keeps the most recent
``capacity`` entries: continuing a conversation marks its whole chain
recent, so a live conversation is not evicted from under its client.
Deleting a response that later stored responses continue keeps its turn,
hidden (it cannot be read, deleted again or continued), for as long as they
need it: a response that can be read back can be continued, as on OpenAI.
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
    hidden: bool = False  # deleted, kept as the turn of the responses that continue it


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
                _, evicted = self._entries.popitem(last=False)
                self._drop_unneeded(evicted.previous_id)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            return None if entry is None or entry.hidden else entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.hidden:
                return False
            entry.hidden = True
            self._drop_unneeded(response_id)
            return True

    def _drop_unneeded(self, response_id: str | None) -> None:
        """Drop hidden entries from ``response_id`` up its chain while no
        stored response continues them."""
        while response_id is not None:
            entry = self._entries.get(response_id)
            if entry is None or not entry.hidden:
                return
            if any(e.previous_id == response_id for e in self._entries.values()):
                return
            del self._entries[response_id]
            response_id = entry.previous_id

    def history(self, response_id: str) -> list[dict] | None:
        """The conversation up to and including ``response_id`` as chat
        messages, oldest first; None unless the whole chain is stored (and
        ``response_id`` itself not deleted)."""
        with self._lock:
            if response_id in self._entries and self._entries[response_id].hidden:
                return None
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
