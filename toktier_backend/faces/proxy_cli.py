"""The ``proxy`` subcommand: ``toktier proxy --upstream URL [--tokenizer SPEC] [--port N] ...``.

``toktier_backend/cli.py`` wires it with ``add_proxy_parser(subparsers)``.
"""

from __future__ import annotations

import argparse

from toktier_backend.faces.proxy import DEFAULT_SESSION_HEADER


def add_proxy_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``proxy`` to an ``argparse`` subparsers object; the parsed namespace's ``func`` runs it."""
    p = subparsers.add_parser(
        "proxy",
        help="OpenAI completion/chat in, exact token IDs out to an upstream /v1/completions (e.g. Dynamo)",
        description=(
            "Accept OpenAI /v1/completions and /v1/chat/completions requests, render chat messages with the "
            "tokenizer's chat template (sandboxed jinja2), tokenize with session repair (sessions keyed by "
            "--session-header or the body's conversation_id/session_id, else by prompt prefix), and forward "
            "the token IDs as `prompt` to UPSTREAM/v1/completions. Runs until SIGTERM or SIGINT."
        ),
    )
    p.add_argument("--upstream", required=True, help="base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json, a folder holding one (and tokenizer_config.json), or a Hub id; default bundled GPT-2")
    p.add_argument("--chat-template", default=None,
                   help="chat template file (.jinja, or .json with chat_template); default: the one beside the tokenizer")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--session-header", default=DEFAULT_SESSION_HEADER, help="request header that keys a session")
    p.add_argument("--max-sessions", type=int, default=256, help="sessions held (LRU beyond)")
    p.add_argument("--min-prefix-chars", type=int, default=2048,
                   help="prompts without a session key at least this long (chars) find their session by prefix")
    p.add_argument("--session-idle-seconds", type=float, default=600.0, help="idle time after which a session is dropped")
    p.add_argument("--timeout", type=float, default=600.0, help="upstream timeout in seconds")
    p.add_argument("--verifier-rate", type=float, default=0.01,
                   help="share of replies the shadow verifier re-checks against the HF reference (plus the first 32)")
    p.add_argument("--quarantine-file", default="",
                   help="quarantine file shared with other servers (default $TOKTIER_STATE_DIR or "
                        "~/.cache/toktier_backend/quarantine.json)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve the toktier_* metrics on this port")
    p.set_defaults(func=run_proxy)
    return p


def run_proxy(args: argparse.Namespace) -> int:
    from toktier_backend.faces.proxy import serve_proxy
    from toktier_backend.serving.core import CoreConfig

    config = CoreConfig(max_sessions=args.max_sessions, min_prefix_chars=args.min_prefix_chars,
                        session_ttl_s=args.session_idle_seconds, verifier_rate=args.verifier_rate,
                        quarantine_file=args.quarantine_file)
    return serve_proxy(
        args.tokenizer,
        args.upstream,
        host=args.host,
        port=args.port,
        chat_template=args.chat_template,
        session_header=args.session_header,
        config=config,
        timeout_s=args.timeout,
        metrics_port=args.metrics_port,
    )
