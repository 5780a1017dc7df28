"""What the routes share: settings, the engine (once loaded), the tokenizer,
metrics and the grammar compiler."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import APIError
from .metrics import Metrics


@dataclass
class ServerSettings:
    model_name: str = "default"
    api_key: str | None = None
    default_max_tokens: int = 512
    default_temperature: float | None = None  # None: the API's default (1.0)
    default_top_p: float | None = None
    default_top_k: int | None = None
    max_body_bytes: int = 32 << 20
    retry_after_s: int = 1
    heartbeat_s: float = 10.0  # Anthropic ping / disconnect poll interval
    disconnect_poll_s: float = 1.0


@dataclass
class ServerState:
    settings: ServerSettings = field(default_factory=ServerSettings)
    engine: Any = None
    tokenizer: Any = None
    model: Any = None
    status: str = "loading"  # loading | ready | failed | stopping
    load_error: str | None = None
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))
    _grammar: Any = None

    def set_ready(self, model, tokenizer, engine) -> None:
        self.model, self.tokenizer, self.engine = model, tokenizer, engine
        self.status = "ready"

    @property
    def system_fingerprint(self) -> str:
        h = hashlib.sha256(self.settings.model_name.encode()).hexdigest()[:10]
        return f"fp_mlxfast_{h}"

    @property
    def max_model_len(self) -> int:
        n = getattr(self.engine, "max_model_len", None)
        if isinstance(n, int) and n > 0:
            return n
        cfg = getattr(self.model, "config", None) or {}
        if isinstance(cfg, dict):
            return int(cfg.get("max_position_embeddings") or 4096)
        return int(getattr(cfg, "max_position_embeddings", 4096))

    @property
    def model_vocab_size(self) -> int:
        cfg = getattr(self.model, "config", None) or {}
        v = cfg.get("vocab_size") if isinstance(cfg, dict) else getattr(cfg, "vocab_size", None)
        return max(int(v or 0), int(self.tokenizer.vocab_size))

    def engine_alive(self) -> bool:
        e = self.engine
        if e is None:
            return False
        return bool(getattr(e, "alive", True))

    def require_ready(self):
        """The engine, or a 503 saying why there is none."""
        if self.status == "loading" or self.engine is None:
            raise APIError(503, "the model is still loading", "overloaded_error",
                           headers={"Retry-After": "5"})
        if self.status == "stopping":
            raise APIError(503, "the server is shutting down", "overloaded_error")
        if not self.engine_alive():
            err = getattr(self.engine, "error", None)
            raise APIError(503, f"the engine has stopped: {err or 'unknown error'}", "server_error")
        return self.engine

    @property
    def grammar(self):
        if self._grammar is None:
            from .grammar import GrammarCompiler

            self._grammar = GrammarCompiler(self.tokenizer, self.model_vocab_size)
        return self._grammar

    def engine_stats(self) -> dict:
        e = self.engine
        if e is None or not hasattr(e, "stats"):
            return {}
        try:
            s = e.stats()
            return s if isinstance(s, dict) else {}
        except Exception:  # stats must never break /metrics
            return {}
