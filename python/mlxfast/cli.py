"""``mlxfast serve | generate | convert``."""

from __future__ import annotations

import argparse
import sys


def _generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mlxfast generate", description="Generate text with a model.")
    p.add_argument("--model", default=None, help="HF/MLX directory or GGUF file (default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None,
                   help="with the same sampling values, the server's tokens for the same prompt")
    p.add_argument("--no-chat", action="store_true", help="feed the prompt as raw text, without the chat template")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file (or the template text itself) used instead of the model's own")
    p.add_argument("--matmul-activations", default="fp32", choices=["fp32", "int8"],
                   help="activations of the quantized matmuls: fp32 (default, exact) or int8 "
                        "(opt-in, AVX-512 VNNI CPUs; see mlxfast serve --help)")
    args = p.parse_args(argv)

    from . import load, stream_generate
    from .text.chat_template import load_chat_template

    template = None
    if args.chat_template is not None:
        try:
            template = load_chat_template(args.chat_template)
        except ValueError as e:
            print(f"mlxfast: error: --chat-template: {e}", file=sys.stderr)
            return 1
    try:
        model, tokenizer = load(args.model, matmul_activations=args.matmul_activations)
    except ValueError as e:
        print(f"mlxfast: error: {e}", file=sys.stderr)
        return 1
    if template is not None:
        tokenizer.chat_template = template
    for chunk in stream_generate(
        model, tokenizer, args.prompt, max_tokens=args.max_tokens, temp=args.temp,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty, seed=args.seed,
        chat=not args.no_chat,
    ):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _convert(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mlxfast convert", description="Convert a GGUF file to an HF/MLX directory.")
    p.add_argument("gguf")
    p.add_argument("out_dir")
    p.add_argument("--dequantize", action="store_true", help="write every quantized tensor as float32")
    args = p.parse_args(argv)
    from .convert import convert_gguf

    out = convert_gguf(args.gguf, args.out_dir, dequantize=args.dequantize)
    print(f"wrote {out}")
    return 0


def _serve(argv: list[str]) -> int:
    from .serve import main as serve_main

    return serve_main(argv)


COMMANDS = {"serve": _serve, "generate": _generate, "convert": _convert}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print("usage: mlxfast {serve,generate,convert} [options]  (mlxfast CMD --help)", file=sys.stderr)
        return 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except (OSError, ValueError) as e:
        print(f"mlxfast: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
