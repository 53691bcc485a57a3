"""The ``serve`` subcommand: ``toktier serve --tokenizer SPEC [--model-repository DIR] [ports]``.

``toktier_backend/cli.py`` wires it with ``add_serve_parser(subparsers)``; ``python -m
toktier_backend.serving.cli_serve ...`` runs it on its own.
"""

from __future__ import annotations

import argparse
import sys


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``serve`` to an ``argparse`` subparsers object; the parsed namespace's ``func`` runs it."""
    p = subparsers.add_parser(
        "serve",
        help="serve toktier_session / toktier_encode on Triton (loopback)",
        description=(
            "Run the model repository on the tritonserver binary shipped in nvidia-pytriton (or, with "
            "--pytriton, the same handler through PyTriton) until SIGTERM or SIGINT."
        ),
    )
    _add_arguments(p)
    p.set_defaults(func=run_serve)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", required=True, help="tokenizer.json path, a folder holding one, a Hub id, or 'default'")
    p.add_argument("--model-repository", default=None, help="model repository to copy (default: model_repository/ of this checkout)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--max-text-bytes", type=int, default=None, help="override the models' max_text_bytes (UTF-8 bytes)")
    p.add_argument(
        "--session-idle-seconds",
        type=float,
        default=None,
        help="override the sequence batcher's max_sequence_idle_microseconds (= session TTL), in seconds",
    )
    p.add_argument("--pytriton", action="store_true", help="serve the same handler through PyTriton instead")
    p.add_argument("--tritonserver", default=None, help="another tritonserver binary with its own Python backend")


def run_serve(args: argparse.Namespace) -> int:
    from toktier_backend.serving.server import serve

    return serve(
        args.tokenizer,
        model_repository=args.model_repository,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        max_text_bytes=args.max_text_bytes,
        session_idle_s=args.session_idle_seconds,
        pytriton=args.pytriton,
        tritonserver=args.tritonserver,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="toktier")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
