"""What the routes share: settings, the engine (once loaded), the tokenizer,
the metrics registry (rendering the engine's stats) and the grammar compiler."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from ..engine.api import EngineLike
from .errors import APIError
from . import metrics


@dataclass
class ServerSettings:
    model_name: str = "default"
    api_key: str | None = None
    default_max_tokens: int | None = None  # None: as many as the context leaves room for
    default_temperature: float | None = None  # None: the API's default (1.0)
    default_top_p: float | None = None
    default_top_k: int | None = None
    model_aliases: tuple[str, ...] = ()  # more names the model answers to (besides "default")
    strict_model_name: bool = False  # unknown model names: 404 instead of the served model
    max_body_bytes: int = 32 << 20
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed to call the API ("*": any)
    # Host header values served (DNS rebinding): None any; () loopback names only
    allowed_hosts: tuple[str, ...] | None = None
    keep_billing_header: bool = False  # False: Claude Code's billing line is cut from system prompts
    metrics_require_key: bool = False  # /metrics is open without the key unless set (as vLLM)
    responses_store_size: int = 1024  # Responses API: recent responses kept for previous_response_id
    webui: bool = True  # the chat page at / (--no-webui: off)
    retry_after_s: int = 1
    heartbeat_s: float = 10.0  # Anthropic ping / disconnect poll interval
    disconnect_poll_s: float = 1.0


@dataclass
class ServerState:
    settings: ServerSettings = field(default_factory=ServerSettings)
    engine: EngineLike | None = None
    tokenizer: Any = None
    model: Any = None
    status: str = "loading"  # loading | ready | failed | stopping
    load_error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _grammar: Any = None
    _responses: Any = None
    _metrics: Any = None

    @property
    def metrics_registry(self):
        """``/metrics``'s prometheus_client registry: it reads ``engine_stats()`` at each scrape."""
        if self._metrics is None:
            self._metrics = metrics.registry(self.engine_stats, lambda: self.settings.model_name)
        return self._metrics

    def set_ready(self, model, tokenizer, engine) -> None:
        self.model, self.tokenizer, self.engine = model, tokenizer, engine
        self.status = "ready"

    @property
    def system_fingerprint(self) -> str:
        h = hashlib.sha256(self.settings.model_name.encode()).hexdigest()[:10]
        return f"fp_mlxfast_{h}"

    @property
    def max_model_len(self) -> int:
        if self.engine is not None:
            return self.engine.max_model_len
        cfg = getattr(self.model, "config", None) or {}
        if isinstance(cfg, dict):
            return int(cfg.get("max_position_embeddings") or 4096)
        return int(getattr(cfg, "max_position_embeddings", 4096))

    @property
    def has_chat_template(self) -> bool | None:
        """Whether the chat APIs can format messages (None while loading)."""
        if self.tokenizer is None:
            return None
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def model_vocab_size(self) -> int:
        cfg = getattr(self.model, "config", None) or {}
        v = cfg.get("vocab_size") if isinstance(cfg, dict) else getattr(cfg, "vocab_size", None)
        return max(int(v or 0), int(self.tokenizer.vocab_size))

    @property
    def served_names(self) -> tuple[str, ...]:
        s = self.settings
        return tuple(dict.fromkeys((s.model_name, *s.model_aliases, "default")))

    def resolve_model(self, requested: str | None) -> str:
        """The name a response reports: always the served name. A request
        may name the model any way (as mlx_lm.server and llama.cpp's server
        accept), unless --strict-model-name makes unknown names a 404."""
        if requested is not None and requested not in self.served_names and self.settings.strict_model_name:
            raise APIError(404, f"the model '{requested}' does not exist; this server serves "
                           + ", ".join(f"'{n}'" for n in self.served_names),
                           "not_found_error", param="model", code="model_not_found")
        return self.settings.model_name

    def engine_alive(self) -> bool:
        e = self.engine
        if e is None:
            return False
        return e.alive

    def require_ready(self):
        """The engine, or a 503 saying why there is none."""
        if self.status == "loading" or self.engine is None:
            raise APIError(503, "the model is still loading", "overloaded_error",
                           headers={"Retry-After": "5"})
        if self.status == "stopping":
            raise APIError(503, "the server is shutting down", "overloaded_error")
        if not self.engine_alive():
            raise APIError(503, f"the engine has stopped: {self.engine.error or 'unknown error'}",
                           "server_error")
        return self.engine

    @property
    def responses(self):
        """The Responses API's store of recent responses."""
        if self._responses is None:
            from .response_store import ResponseStore

            self._responses = ResponseStore(self.settings.responses_store_size)
        return self._responses

    @property
    def grammar(self):
        if self._grammar is None:
            from .grammar import GrammarCompiler

            self._grammar = GrammarCompiler(self.tokenizer, self.model_vocab_size)
        return self._grammar

    def engine_stats(self) -> dict:
        e = self.engine
        if e is None:
            return {}
        try:
            s = e.stats()
            return s if isinstance(s, dict) else {}
        except Exception:  # stats must never break /metrics
            return {}
