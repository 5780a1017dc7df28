"""KV storage outside the RAM pool, as the scheduler sees it (vLLM's KV-connector shape).

The scheduler asks a connector, for a new prompt, how many blocks past the
ones cached in RAM it can load (``num_loadable``), starts the load
(``start_load``), and admits the sequence once the load is among
``finished_loads()``: the loaded blocks are then in the RAM prefix cache,
where the scheduler's own prefix match finds them like any RAM hit. The
connector holds them (and the RAM blocks before them) until ``release``.
Blocks are named by their chained block hashes (group 0's cache keys); a load
is named by an int the scheduler picks. The connector knows nothing of the
scheduler's sequences.

The engine thread drives the connector's own work (``service``: I/O
completions, write-behind; ``save_evicted`` after each schedule, before the
step writes into blocks the allocation evicted) and its lifecycle (``flush``,
``close``, ``stats``). ``NullConnector`` is the connector when there is no
outside storage (``--ssd-cache`` off); ``kv/ssd.py``'s ``SSDTier`` is the
other one.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable


@runtime_checkable
class KVConnector(Protocol):
    enabled: bool

    # -- the scheduler's questions (engine thread) ----------------------------
    def num_loadable(self, keys: Sequence[bytes], start: int, limit: int) -> int:
        """Blocks ``keys[start:]`` (``keys[:start]`` are cached in RAM) that can
        be loaded, consecutively from ``start``, at most ``limit``."""

    def start_load(self, load_id: int, keys: Sequence[bytes], start: int, n: int) -> None:
        """Load ``keys[start:start + n]``, holding ``keys[:start]`` meanwhile."""

    def finished_loads(self) -> list[int]:
        """Loads that have completed (or failed: then fewer blocks, or none,
        were loaded) since the last call."""

    def release(self, load_id: int) -> None:
        """Drop what a load holds (its sequence was admitted, or finished); a
        load still in flight is cancelled."""

    # -- the engine loop ------------------------------------------------------
    def service(self, busy: bool) -> None:
        """Each loop iteration: completions, write-behind, flush requests."""

    def has_work(self) -> bool:
        """Something to do now: the engine should not sleep."""

    def wait_timeout(self) -> float | None:
        """How long the engine may sleep (None: until woken)."""

    def save_evicted(self) -> None:
        """After an allocation: save cached blocks it evicted before they are overwritten."""

    def request_flush(self) -> None:
        """Ask the next ``service`` to write every cached block."""

    # -- any thread -----------------------------------------------------------
    def flush(self, wake: Callable[[], None], timeout: float) -> dict:
        """Write every cached block and wait until durable (``wake`` wakes the engine)."""

    def close(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for pending writes, then stop."""

    def stats(self) -> dict:
        """``{"enabled": ...}`` plus the connector's counters."""


class NullConnector:
    """No storage outside the RAM pool: nothing to load, nothing to save."""

    enabled = False

    def num_loadable(self, keys, start, limit) -> int:
        return 0

    def start_load(self, load_id, keys, start, n) -> None:
        raise RuntimeError("the null connector loads nothing")

    def finished_loads(self) -> list[int]:
        return []

    def release(self, load_id) -> None:
        pass

    def service(self, busy) -> None:
        pass

    def has_work(self) -> bool:
        return False

    def wait_timeout(self) -> float | None:
        return None

    def save_evicted(self) -> None:
        pass

    def request_flush(self) -> None:
        pass

    def flush(self, wake, timeout) -> dict:
        return {"durable": True, "enabled": False}

    def close(self, timeout) -> bool:
        return True

    def stats(self) -> dict:
        return {"enabled": False}
