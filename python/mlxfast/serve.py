"""``mlxfast serve`` / ``python -m mlxfast.serve``: the HTTP server.

The port is bound first (a taken port is a one-line error, exit 1), then the
server answers at once (``/health`` is 503 while the model loads) and the
model loads in the background. SIGINT/SIGTERM stop accepting connections,
let in-flight requests finish for up to ``--shutdown-timeout`` seconds,
abort the rest, and exit 0. The exit is bounded: pending SSD cache writes get
what is left of that time, and a watchdog ends the process shortly after the
deadline whatever a thread is stuck on (a hung disk).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

EXIT_GRACE_S = 2.0  # past --shutdown-timeout, the watchdog ends the process


def _allowed_hosts(bind: str, given: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """Host names served: as given (as Host headers are read: no port, lower
    case); else loopback names only on a loopback address (None, any, on one
    reachable from elsewhere)."""
    from .server.app import host_name, is_loopback

    if given is not None:
        return tuple(host_name(h) for h in given)
    return () if is_loopback(host_name(bind)) else None


def _origins(text: str) -> tuple[str, ...]:
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(value, list) or not all(isinstance(o, str) for o in value):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return tuple(o.strip() for o in value if o.strip())
    return tuple(o.strip() for o in text.split(",") if o.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlxfast serve", description="OpenAI- and Anthropic-compatible LLM server.")
    p.add_argument("--model", default=None, help="HF/MLX directory or GGUF file (default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="the chat template for the chat APIs, replacing the model's own: a Jinja file, or "
                        "the template text itself (a value that is no file and contains '{{' or '{%%'); "
                        "needed for a model that ships without one (its chat requests are a 400 otherwise)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name reported by the API, then any aliases it also answers to")
    p.add_argument("--strict-model-name", action="store_true",
                   help="a request naming a model not served here is a 404 (default: served by this model)")
    p.add_argument("--keep-billing-header", action="store_true",
                   help="keep Claude Code's per-request 'x-anthropic-billing-header:' line in system "
                        "prompts (by default it is cut so the cached system prompt is reused every turn)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", type=int, default=None,
                   help="sequences decoded together (EngineConfig.max_num_seqs)")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="KV pool size in GiB")
    p.add_argument("--max-model-len", type=int, default=None, help="context length cap in tokens")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="dtype of dense KV blocks (auto = the model's activation dtype, float16 for float32 models)")
    p.add_argument("--kv-quant", default=None, help="KV cache scheme: off | 8 | 4 | turbo | turbo:k8v3 (EngineConfig.kv_quant)")
    p.add_argument("--matmul-activations", default="fp32", choices=["fp32", "int8"],
                   help="activations of the quantized matmuls: fp32 (default, exact: mlx-lm's numbers) "
                        "or int8 (opt-in, llama.cpp's Q8_1 scheme on the 4- and 8-bit layers: faster "
                        "on AVX-512 VNNI CPUs, a start-up error on others; quality in README)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="build each decode step while the previous one evaluates (default on; "
                        "--no-async-scheduling runs the steps one after another)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="default max_tokens when a request omits it (default: as many as the context leaves "
                        "room for, as OpenAI, vLLM and llama.cpp's server do)")
    p.add_argument("--temp", type=float, default=None, help="default temperature when a request omits it")
    p.add_argument("--top-p", type=float, default=None, help="default top_p")
    p.add_argument("--top-k", type=int, default=None, help="default top_k")
    p.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer or x-api-key)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    p.add_argument("--max-body-mb", type=float, default=32.0, help="largest request body accepted (413 above)")
    p.add_argument("--allowed-origins", type=_origins, default=(), metavar="ORIGINS",
                   help="browser origins allowed to call the API (CORS), comma-separated or a JSON "
                        "list as vLLM takes it, e.g. 'http://localhost:3000' or '[\"*\"]'; default none")
    p.add_argument("--allowed-hosts", type=_origins, default=None, metavar="HOSTS",
                   help="Host header names the server answers to besides loopback ones, comma-separated "
                        "('*': any); default: loopback names only when listening on a loopback address "
                        "(a guard against DNS rebinding), any otherwise")
    p.add_argument("--metrics-require-key", action="store_true",
                   help="require --api-key on /metrics too (open by default, as vLLM's)")
    p.add_argument("--no-webui", dest="webui", action="store_false",
                   help="do not serve the chat page at / (the API is unchanged)")
    p.add_argument("--draft-kind", choices=["ngram", "model"], default=None,
                   help="speculative decoding (lossless: the output is what decoding without it gives): "
                        "ngram = prompt lookup (drafts from the request's own prompt and output), "
                        "model = drafts from --draft-model (the default when it is given)")
    p.add_argument("--draft-model", default=None, metavar="PATH",
                   help="a smaller model with the same tokenizer (HF/MLX directory or GGUF) that drafts tokens")
    p.add_argument("--num-draft-tokens", type=int, default=None, metavar="N",
                   help="speculative decoding: draft tokens per row and step at most "
                        "(default 8 for ngram, 3 for a draft model; 1..32)")
    p.add_argument("--draft-select", choices=["adaptive", "all"], default=None,
                   help="speculative decoding: verify the draft tokens worth their cost (adaptive, the "
                        "default) or every proposed one (all, as mlx-lm and vLLM do)")
    p.add_argument("--ngram-max", type=int, default=None, metavar="N",
                   help="prompt lookup: the longest trailing n-gram looked up (default 4)")
    p.add_argument("--ngram-min", type=int, default=None, metavar="N",
                   help="prompt lookup: the shortest (default 1)")
    p.add_argument("--responses-store-size", type=int, default=1024, metavar="N",
                   help="Responses API: how many recent responses are kept in memory for previous_response_id "
                        "and GET /v1/responses/{id} (0: none)")
    p.add_argument("--stream-stall-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="abort a request whose client has read none of its output for this long")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGINT/SIGTERM, in-flight requests get this many seconds to finish, then pending "
                        "SSD cache writes get what is left; the process exits at most 2 s after that")
    p.add_argument("--ssd-cache", default=None, metavar="DIR",
                   help="keep prefix-cache KV blocks on disk in DIR (survives restarts; off by default). "
                        "Best a private directory: one that others can write to is warned about")
    p.add_argument("--ssd-cache-max", type=float, default=32.0, metavar="GB",
                   help="byte cap of the SSD cache in GiB (oldest used blocks evicted)")
    p.add_argument("--ssd-demote-idle", type=float, default=None, metavar="SECONDS",
                   help="move cached blocks unused this long to the SSD cache and free their RAM")
    p.add_argument("--ssd-cache-verify", action=argparse.BooleanOptionalAction, default=True,
                   help="check every restored block's data checksum (default on: a flipped "
                        "data byte must never be served; headers are always checked). "
                        "--no-ssd-cache-verify trusts the directory's contents")
    p.add_argument("--ssd-flush-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on shutdown, wait at most this long for pending SSD cache writes "
                        "(within --shutdown-timeout)")
    p.add_argument("--ssd-restore-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a restore from the SSD cache not done within this time (a slow or hung "
                        "disk) is abandoned and the prompt computed")
    p.add_argument("--tensor-parallel-size", "--tp", dest="tensor_parallel_size", type=int, default=None,
                   metavar="N", help="shard the model over N ranks (tensor parallelism): started here on "
                                     "loopback with the ring backend, or give the ranks yourself with "
                                     "'mlx.launch ... -- mlxfast serve ...' (any launch it supports)")
    p.add_argument("--tp-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="tensor parallelism: ranks that do not connect, or a step or heartbeat that does "
                        "not finish, within this time (a rank that hangs) end the server with an error")
    return p


def _say(msg: str) -> None:
    print(f"mlxfast: {msg}", flush=True)


def _fail(msg: str) -> int:
    print(f"mlxfast: error: {msg}", file=sys.stderr, flush=True)
    return 1


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _engine_config(args):
    from .engine.config import EngineConfig

    wanted = {"stream_stall_timeout_s": args.stream_stall_timeout, "max_num_seqs": args.max_batch,
              "kv_cache_gb": args.kv_cache_gb,
              "max_model_len": args.max_model_len, "kv_quant": args.kv_quant,
              "kv_dtype": None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
              "ssd_cache_dir": args.ssd_cache, "ssd_cache_max_gb": args.ssd_cache_max,
              "ssd_demote_idle_s": args.ssd_demote_idle, "ssd_cache_verify": args.ssd_cache_verify,
              "ssd_flush_timeout_s": args.ssd_flush_timeout,
              "ssd_restore_timeout_s": args.ssd_restore_timeout, "spec_kind": args.draft_kind,
              "num_draft_tokens": args.num_draft_tokens, "ngram_min": args.ngram_min,
              "ngram_max": args.ngram_max, "draft_select": args.draft_select,
              "async_scheduling": args.async_scheduling}
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in wanted.items() if v is not None and k in names})


def _load_draft(load_model, path: str, tokenizer):
    """The draft model, refused unless its tokenizer is the target's."""
    try:
        draft, dtok = load_model(path)
    except Exception as e:
        raise ValueError(f"the draft model {path} could not be loaded: {e}") from None
    if dtok.vocab_size != tokenizer.vocab_size or any(
            dtok.id_to_token(i) != tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)):
        raise ValueError(f"the draft model {path} has another tokenizer than the target "
                         f"({dtok.vocab_size} vs {tokenizer.vocab_size} tokens, or different ones): "
                         "a draft model must share the target's vocabulary")
    return draft


def _model_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name[0]
    if args.model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(args.model)
    return path.stem if path.suffix == ".gguf" else path.name


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    level = args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    from .server.app import create_app
    from .server.http_errors import JSONErrorH11Protocol
    from .server.state import ServerSettings, ServerState

    settings = ServerSettings(
        model_name=_model_name(args), api_key=args.api_key, default_max_tokens=args.max_tokens,
        default_temperature=args.temp, default_top_p=args.top_p, default_top_k=args.top_k,
        max_body_bytes=int(args.max_body_mb * (1 << 20)), metrics_require_key=args.metrics_require_key,
        allowed_origins=args.allowed_origins, strict_model_name=args.strict_model_name,
        allowed_hosts=_allowed_hosts(args.host, args.allowed_hosts),
        model_aliases=tuple(args.served_model_name[1:]) if args.served_model_name else (),
        keep_billing_header=args.keep_billing_header, responses_store_size=args.responses_store_size,
        webui=args.webui,
    )
    if args.max_tokens is not None and args.max_tokens < 1:
        return _fail("--max-tokens must be at least 1")
    if args.matmul_activations == "int8":
        from .ops import int8_activations_unsupported, on_cpu

        missing = on_cpu() and int8_activations_unsupported()
        if missing:
            return _fail(f"--matmul-activations int8: {missing}")
    if args.responses_store_size < 0:
        return _fail("--responses-store-size must be 0 or more")
    if args.draft_model is not None and args.draft_kind is None:
        args.draft_kind = "model"
    if args.draft_kind == "model" and args.draft_model is None:
        return _fail("--draft-kind model needs --draft-model PATH")
    if args.draft_kind == "ngram" and args.draft_model is not None:
        return _fail("--draft-kind ngram drafts by prompt lookup; it takes no --draft-model")
    if args.draft_kind == "model" and (args.ngram_min is not None or args.ngram_max is not None):
        return _fail("--ngram-min and --ngram-max are for --draft-kind ngram")
    if args.draft_kind is None and any(v is not None for v in (args.num_draft_tokens, args.ngram_min,
                                                               args.ngram_max, args.draft_select)):
        return _fail("--num-draft-tokens, --draft-select, --ngram-min and --ngram-max need --draft-kind")
    if args.draft_kind == "model" and args.num_draft_tokens is None:
        args.num_draft_tokens = 3
    if args.num_draft_tokens is not None and not 1 <= args.num_draft_tokens <= 32:
        return _fail("--num-draft-tokens must be within 1..32")
    n_min, n_max = args.ngram_min or 1, args.ngram_max or 4
    if args.draft_kind and not 1 <= n_min <= n_max:
        return _fail(f"--ngram-min ({n_min}) must be at least 1 and at most --ngram-max ({n_max})")
    chat_template = None
    if args.chat_template is not None:
        from .text.chat_template import load_chat_template

        try:
            chat_template = load_chat_template(args.chat_template)
        except ValueError as e:
            return _fail(f"--chat-template: {e}")
    tp_size = args.tensor_parallel_size
    if tp_size is not None and tp_size < 1:
        return _fail("--tensor-parallel-size must be at least 1")
    from .engine import distributed

    launched = distributed.launched()
    if not launched and (tp_size or 1) > 1:  # N ranks of this command on loopback
        _say(f"starting {tp_size} tensor-parallel ranks on loopback (ring backend)")
        return distributed.launch_local(tp_size, sys.argv[1:] if argv is None else list(argv))
    if launched and distributed.launch_rank() != 0:
        return _follow(args)
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        reason = "the port is already in use" if e.errno in (98, 48) else (e.strerror or str(e))
        return _fail(f"cannot listen on {args.host}:{args.port}: {reason}")

    state = ServerState(settings=settings)
    app = create_app(state)
    config = uvicorn.Config(
        app, log_level=args.log_level, access_log=args.log_level == "debug",
        timeout_graceful_shutdown=max(1, int(args.shutdown_timeout)), lifespan="off",
        http=JSONErrorH11Protocol,  # HTTP-level 400s in the API's error shape
    )

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # Like uvicorn's, without re-raising the signal afterwards:
            # a graceful stop exits 0.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            old = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

        def handle_exit(self, sig, frame):
            if state.status == "ready":
                state.status = "stopping"
            start_deadline()
            super().handle_exit(sig, frame)

    server = Server(config)
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{args.port}"
    exit_code = [0]
    deadline: list[float] = []  # when the process must be gone, from the first stop request
    finished = threading.Event()

    def start_deadline():
        if deadline:
            return
        deadline.append(time.monotonic() + args.shutdown_timeout)

        def watchdog():
            if not finished.wait(args.shutdown_timeout + EXIT_GRACE_S):
                print("mlxfast: warning: shutdown did not finish in time; exiting now",
                      file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(exit_code[0])

        threading.Thread(target=watchdog, name="mlxfast-exit-watchdog", daemon=True).start()

    def load():
        try:
            t0 = time.perf_counter()
            _say(f"loading model {args.model or '(built-in SmolLM2-135M-Instruct)'} ...")
            from . import load as load_model
            from .engine.engine import Engine

            group = liveness = None
            if launched:  # rank 0 of a tensor-parallel launch
                group = distributed.init_group(args.tp_timeout)
                if tp_size is not None and group.size() != tp_size:
                    raise ValueError(f"--tensor-parallel-size {tp_size} but the launch has {group.size()} ranks")
                if group.size() > 1:
                    liveness = distributed.Liveness(group, tp_lost)
            model, tokenizer = load_model(args.model, matmul_activations=args.matmul_activations)
            if args.matmul_activations != "fp32":
                _say(f"matmul activations: {args.matmul_activations}")
            if group is not None and group.size() > 1:
                from .models.shard import shard_model

                distributed.check_same_model(group, model)
                shard_model(model, group)
            if chat_template is not None:
                own = "replacing the model's own" if tokenizer.chat_template else "the model has none"
                _say(f"chat template from --chat-template ({own})")
                # Before the engine is built: it reads the end tokens, which
                # include the template's turn end.
                tokenizer.chat_template = chat_template
            elif not tokenizer.chat_template:
                print("mlxfast: warning: the model has no chat template: chat requests get a 400 "
                      "until the server is started with --chat-template FILE; /v1/completions works",
                      file=sys.stderr, flush=True)
            config = _engine_config(args)
            if args.draft_model is not None:
                config.draft_model = _load_draft(load_model, args.draft_model, tokenizer)
            if group is not None and group.size() > 1:
                config.tp_channel = distributed.StepChannel(group, timeout_s=args.tp_timeout,
                                                            on_timeout=tp_hangs)
                config.tp_channel.liveness = liveness
            engine = Engine(model, tokenizer, config)
            if config.tp_channel is not None:
                engine.on_death = tp_died
            engine.start()
            while not server.started and not server.should_exit:
                time.sleep(0.01)
            state.set_ready(model, tokenizer, engine)
            # A wildcard address is no place to point a browser at: the page is on loopback there.
            local = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(args.host)
            page_url = f"http://{local}:{args.port}/" if local else f"{url}/"
            page = f"; chat page: {page_url}" if settings.webui else ""
            tp_note = "" if group is None or group.size() < 2 else \
                f", tensor parallel over {group.size()} ranks"
            _say(f"model loaded in {time.perf_counter() - t0:.1f}s; ready on {url} "
                 f"(model '{settings.model_name}', context {state.max_model_len} tokens{tp_note}){page}")
        except BaseException as e:  # report, then stop the server
            state.status = "failed"
            state.load_error = f"{type(e).__name__}: {e}"
            print(f"mlxfast: error: could not start the model: {e}", file=sys.stderr, flush=True)
            exit_code[0] = 1
            server.should_exit = True

    def tp_died(error: str) -> None:
        """A tensor-parallel engine that dies ends the server: the requests in
        flight have their errors; the server stops after they are written."""
        print(f"mlxfast: error: tensor-parallel serving stopped: {error}", file=sys.stderr, flush=True)
        exit_code[0] = 1
        threading.Timer(0.5, lambda: setattr(server, "should_exit", True)).start()

    def tp_lost(rank: int) -> None:
        """The liveness link (engine/distributed.py): a rank's process has ended."""
        msg = f"tensor-parallel rank {rank} is gone (its process ended or its host is unreachable)"
        e = state.engine
        if e is None:  # still starting
            print(f"mlxfast: error: {msg}", file=sys.stderr, flush=True)
            os._exit(1)
        e.fail(msg)

    def tp_hangs(msg: str) -> None:
        """The watchdog (a rank hangs; the engine thread is stuck in a
        collective): the requests in flight get their error before the
        process ends."""
        e = state.engine
        if e is not None and e.alive:
            e._die(TimeoutError(msg))
            time.sleep(1.0)

    loader = threading.Thread(target=load, name="mlxfast-load", daemon=True)
    loader.start()
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        if state.status == "ready":
            state.status = "stopping"
        start_deadline()
        engine = state.engine
        if engine is not None:
            left = max(0.0, deadline[0] - time.monotonic())
            try:  # the engine thread stops in milliseconds; give it a second even past the deadline
                engine.shutdown(timeout=max(1.0, left) if engine.alive else 1.0, ssd_flush_timeout=left)
            except Exception as e:  # never a traceback on the way out
                print(f"mlxfast: warning: engine shutdown: {e}", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            sock.close()
        finished.set()
        if launched and exit_code[0]:
            # A failed tensor-parallel server: its engine thread may be stuck in
            # a collective of a dead peer, which interpreter shutdown would wait on.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exit_code[0])
    if exit_code[0] == 0:
        _say("stopped")
    return exit_code[0]


def _follow(args) -> int:
    """A tensor-parallel rank other than 0: load the same model, shard it and
    run rank 0's steps until it stops us (no HTTP)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def stopping(sig, frame):
        # A terminal's Ctrl-C or a process group's SIGTERM reaches every rank:
        # rank 0 stops us (a STOP after its requests end); alone, we go later.
        def later():
            time.sleep(args.shutdown_timeout + EXIT_GRACE_S + 3.0)
            os._exit(128 + sig)

        threading.Thread(target=later, daemon=True).start()

    signal.signal(signal.SIGINT, stopping)
    signal.signal(signal.SIGTERM, stopping)
    from . import load as load_model
    from .engine import distributed
    from .models.shard import ShardError, shard_model

    rank = distributed.launch_rank()
    try:
        group = distributed.init_group(args.tp_timeout)
        if args.tensor_parallel_size is not None and group.size() != args.tensor_parallel_size:
            raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size} but the launch has "
                             f"{group.size()} ranks")
        def lost(_rank0: int) -> None:  # the link to rank 0 closed: it has ended
            time.sleep(3.0)  # a clean STOP ends this process first
            print(f"mlxfast: error: rank {rank}: rank 0 is gone; exiting", file=sys.stderr, flush=True)
            os._exit(1)

        liveness = distributed.Liveness(group, lost)
        model, _ = load_model(args.model, matmul_activations=args.matmul_activations)
        distributed.check_same_model(group, model)
        shard_model(model, group)
        channel = distributed.StepChannel(group, timeout_s=args.tp_timeout)
        channel.liveness = liveness  # rank 0 rings it before each message: an idle rank sleeps
        distributed.Follower(model, channel).run()
    except (ShardError, ValueError, FileNotFoundError, ConnectionError) as e:
        return _fail(f"rank {rank}: could not start the model: {e}")
    except RuntimeError as e:  # the backend's "connection to a peer was lost", a mismatched model
        return _fail(f"rank {rank}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
