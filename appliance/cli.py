"""The `appliance` command: serve, generate, db, bench, report, tune."""

from __future__ import annotations

import argparse
import sys

from .policies import POLICIES


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Model and engine flags shared by `serve` and `generate` (vLLM's names)."""
    parser.add_argument("--model", default=None, help="local transformers folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=None, help="auto, cpu or cuda[:N]")
    parser.add_argument("--block-size", type=int, default=None)
    kv = parser.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 1GiB")
    kv.add_argument("--num-blocks", type=int, default=None, help="KV cache size in blocks")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--long-prefill-token-threshold", type=int, default=None, help="prefill chunk size")
    parser.add_argument("--max-num-partial-prefills", type=int, default=None)
    parser.add_argument("--max-long-partial-prefills", type=int, default=None)
    parser.add_argument("--scheduling-policy", default=None, choices=POLICIES)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="reuse the KV blocks of cached prompt prefixes (default on; a live knob)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--cpu-kernels", action=argparse.BooleanOptionalAction, default=None,
                        help="C kernels on the CPU (decode attention over the paged cache, the layers' elementwise "
                             "ops), built with gcc at first start; --no-cpu-kernels runs torch alone")
    parser.add_argument("--config", default=None, help="TOML file (e.g. configs/cpu.toml); flags override it")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    from .server.cli import add_serve_arguments

    serve = sub.add_parser("serve", help="run the OpenAI-compatible server and the dashboard")
    _add_engine_arguments(serve)
    add_serve_arguments(serve)

    gen = sub.add_parser("generate", help="generate text for one prompt from the command line")
    _add_engine_arguments(gen)
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)

    db = sub.add_parser("db", help="manage the telemetry store schema")
    db.add_argument("action", choices=["upgrade", "current", "downgrade"])
    db.add_argument("revision", nargs="?", default=None)
    db.add_argument("--db", default=None, help="SQLAlchemy URL (default: sqlite:///appliance.db)")

    from .bench.cli import add_bench_arguments

    add_bench_arguments(sub.add_parser("bench", help="load-test an OpenAI-compatible server"))

    from .bench.report.cli import add_report_arguments
    from .bench.tune_cli import add_tune_arguments

    add_report_arguments(sub.add_parser("report", help="write a tuning report for stored runs"))
    add_tune_arguments(sub.add_parser("tune", help="sweep the knobs on a running server"))
    return parser


def main(argv: list[str] | None = None) -> int:
    import logging

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "serve":
            from .server.cli import serve_main

            return serve_main(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "db":
            return _db(args)
        if args.command == "bench":
            from .bench.cli import bench_main

            return bench_main(args)
        if args.command == "report":
            from .bench.report.cli import report_main

            return report_main(args)
        if args.command == "tune":
            from .bench.tune_cli import tune_main

            return tune_main(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"appliance {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 2


def _generate(args: argparse.Namespace) -> int:
    from .engine import LLMEngine, SamplingParams
    from .settings import engine_config_from_args

    engine = LLMEngine(engine_config_from_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    prompt = engine.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else engine.encode_prompt(args.prompt)
    out = engine.generate([prompt], params)[0]
    print(out.text)
    return 0


def _db(args: argparse.Namespace) -> int:
    from .telemetry import store

    url = args.db or store.DEFAULT_URL
    if args.action == "upgrade":
        store.upgrade(url, args.revision or "head")
        print(f"{url}: at {store.current(url)}")
    elif args.action == "downgrade":
        if not args.revision:
            raise ValueError("db downgrade needs a revision (e.g. -1 or base)")
        store.downgrade(url, args.revision)
        print(f"{url}: at {store.current(url)}")
    else:
        print(store.current(url) or "empty (no schema yet)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
