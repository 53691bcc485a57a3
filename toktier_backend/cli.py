"""The ``toktier`` command: ``demo`` (the main job), ``encode``, ``info``, ``guard-tables``, ``proxy``,
``fleet``, ``dynamo``, and ``serve`` when the serving layer (``deploy/cli_serve.py``) imports."""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    if args.local:
        from toktier_backend.demo import run_local

        return 1 if run_local(args.tokenizer, args.sessions) else 0
    from toktier_backend.demo import run_served

    return run_served(args.tokenizer, args.sessions, protocol=args.protocol, url=args.url,
                      ready_timeout_s=args.ready_timeout, repeat=args.repeat, context_chars=args.context_chars,
                      plot=None if args.no_plot else (args.plot or "default"))


def _encode(args) -> int:
    from toktier_backend.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    text = sys.stdin.read() if args.text is None else args.text
    print(" ".join(map(str, tok.encode(text, add_special_tokens=not args.no_special).tolist())))
    return 0


def _info(args) -> int:
    import json

    from toktier_backend.tokenizer import load_tokenizer

    print(json.dumps(load_tokenizer(args.tokenizer).describe(), indent=2))
    return 0


def _guard_tables(args) -> int:
    from toktier_backend.engines.admission import main as guard_tables_main

    guard_tables_main(args.files + (["--cache"] if args.cache else []) + [a for e in args.engine or () for a in ("--engine", e)])
    return 0


def _dynamo(args) -> int:
    from toktier_backend.faces.dynamo import main  # imports ai-dynamo only when the command runs

    return main(args.args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="toktier", description="Exact, stateful tokenization for LLM serving.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "demo",
        help="serve, replay real agent sessions through the client and check every reply against HF",
        description=(
            "Start tritonserver (nvidia-pytriton) with the tokenizer, replay agent sessions turn by turn on a "
            "~400K-char base context through the client (toktier_session in full-text and delta+patch mode, "
            "toktier_encode_fast as the full re-encode), check every reply against the HF reference and print "
            "per-turn latencies and routes; then grow one session from 10K to 1M+ chars and plot latency vs "
            "context size (PNG). "
            "Exit code: 0 all exact, 1 mismatches, 2 server failure, 130/143 Ctrl-C/SIGTERM. The server is always "
            "stopped. --local replays through the library instead (no server)."
        ),
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer.json, folder or Hub id (default: bundled GPT-2)")
    p.add_argument("--sessions", default=None, help="folder of SWE-agent *.traj files (default: bundled sample)")
    p.add_argument("--local", action="store_true", help="library-only replay, no server (no serve extra needed)")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc", help="client protocol (default grpc)")
    p.add_argument("--url", default=None,
                   help="HOST:PORT of a running `toktier serve` with the same tokenizer, instead of starting one")
    p.add_argument("--repeat", type=int, default=1, help="replay the sessions N times for more samples (default 1)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for the server (default 300)")
    p.add_argument("--context-chars", type=int, default=400_000,
                   help="base context before every session's turns, chars (default 400000; 0: none)")
    p.add_argument("--plot", default=None, help="PNG path of the latency-vs-context plot (default: "
                   "<tmp>/toktier-demo/latency_vs_context.png)")
    p.add_argument("--no-plot", action="store_true", help="skip the 10K-to-1M-char sweep and its plot")
    p.set_defaults(func=_demo)
    p = sub.add_parser("encode", help="print the ids of TEXT (or stdin)")
    p.add_argument("text", nargs="?")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json, folder, Hub id or default (bundled GPT-2)")
    p.add_argument("--no-special", action="store_true", help="add_special_tokens=False")
    p.set_defaults(func=_encode)
    p = sub.add_parser("info", help="family, engine and admission of a tokenizer file")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json, folder, Hub id or default (bundled GPT-2)")
    p.set_defaults(func=_info)
    p = sub.add_parser("guard-tables", help="precompute engine guard sets (exhaustive over Unicode)")
    p.add_argument("files", nargs="+")
    p.add_argument("--cache", action="store_true", help="write to the user cache, not package data")
    p.add_argument("--engine", action="append", default=None,
                   help="engine to compute for (repeatable; default: every fast engine that loads the file)")
    p.set_defaults(func=_guard_tables)
    try:  # the serving layer registers `serve` when it is present
        from toktier_backend.deploy.cli_serve import add_serve_parser

        add_serve_parser(sub)
    except ImportError:
        pass
    from toktier_backend.faces.proxy_cli import add_proxy_parser

    add_proxy_parser(sub)
    from toktier_backend.deploy.fleet import add_fleet_parser  # stdlib only: replicas + nginx (`toktier fleet`)

    add_fleet_parser(sub)
    p = sub.add_parser("dynamo", add_help=False, prefix_chars="\0",
                       help="Dynamo's frontend (all its flags) with the toktier chat processor (needs ai-dynamo)")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_dynamo)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
