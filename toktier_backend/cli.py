"""The ``toktier`` command: ``demo`` (the main job), ``encode``, ``info``, ``guard-tables``; the serving
issue adds ``serve``."""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    from .demo import run_local

    return 1 if run_local(args.tokenizer, args.sessions) else 0


def _encode(args) -> int:
    from .api import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    text = sys.stdin.read() if args.text is None else args.text
    print(" ".join(map(str, tok.encode(text, add_special_tokens=not args.no_special).tolist())))
    return 0


def _info(args) -> int:
    import json

    from .api import load_tokenizer

    print(json.dumps(load_tokenizer(args.tokenizer).describe(), indent=2))
    return 0


def _guard_tables(args) -> int:
    from .admission import _main

    _main(args.files + (["--cache"] if args.cache else []))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="toktier", description="Exact, stateful tokenization for LLM serving.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="replay real agent sessions and check every reply against HF")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json, folder or Hub id (default: bundled GPT-2)")
    p.add_argument("--sessions", default=None, help="folder of SWE-agent *.traj files (default: bundled sample)")
    p.set_defaults(func=_demo)
    p = sub.add_parser("encode", help="print the ids of TEXT (or stdin)")
    p.add_argument("text", nargs="?")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--no-special", action="store_true", help="add_special_tokens=False")
    p.set_defaults(func=_encode)
    p = sub.add_parser("info", help="family, engine and admission of a tokenizer file")
    p.add_argument("--tokenizer", default=None)
    p.set_defaults(func=_info)
    p = sub.add_parser("guard-tables", help="precompute engine guard sets (exhaustive over Unicode)")
    p.add_argument("files", nargs="+")
    p.add_argument("--cache", action="store_true", help="write to the user cache, not package data")
    p.set_defaults(func=_guard_tables)
    try:  # the serving layer registers `serve` when it is present
        from .serving.cli_serve import add_serve_parser

        add_serve_parser(sub)
    except ImportError:
        pass
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
