"""The ``serve`` subcommand: ``toktier serve --tokenizer SPEC [--model-repository DIR] [ports]``.

``toktier_backend/cli.py`` wires it with ``add_serve_parser(subparsers)``; ``python -m
toktier_backend.deploy.cli_serve ...`` runs it on its own.
"""

from __future__ import annotations

import argparse
import sys

from toktier_backend.tokenizer import FAST_ROUTES


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
    _add_ops_parsers(subparsers)
    return p


def _add_ops_parsers(subparsers) -> None:
    """``toktier quarantine ...`` and ``toktier metrics ...`` (operations of a running server)."""
    q = subparsers.add_parser(
        "quarantine",
        help="list or clear routes the shadow verifier quarantined",
        description=(
            "The shadow verifier quarantines a fast route (full, append, edit) per tokenizer file and engine "
            "build when a sampled reply disagrees with the HF reference; it stays quarantined (served by the "
            "reference) until cleared here. Every model instance re-reads the file within a second."
        ),
    )
    q.add_argument("action", choices=("list", "clear", "add"))
    q.add_argument("--file", default=None, help="quarantine file (default: the models' default, "
                   "$TOKTIER_STATE_DIR or ~/.cache/toktier_backend/quarantine.json)")
    q.add_argument("--key", default=None, help="build key or a prefix of it, e.g. the tokenizer sha256 (default: all)")
    q.add_argument("--route", default=None, choices=FAST_ROUTES, help="one route (default: all)")
    q.add_argument("--reason", default="operator", help="for add")
    q.set_defaults(func=run_quarantine)
    m = subparsers.add_parser("metrics", help="serve the aggregated toktier_* metrics of a tritonserver's instances")
    m.add_argument("--multiproc-dir", default=None, help="the instances' PROMETHEUS_MULTIPROC_DIR")
    m.add_argument("--host", default="127.0.0.1")
    m.add_argument("--port", type=int, default=8003)
    m.set_defaults(func=run_metrics)


def run_quarantine(args: argparse.Namespace) -> int:
    import json

    from toktier_backend.config import default_quarantine_file
    from toktier_backend.serving.verifier import QuarantineFile

    f = QuarantineFile(args.file or default_quarantine_file())
    if args.action == "list":
        print(json.dumps(f.load(), indent=2, sort_keys=True))
    elif args.action == "clear":
        released = f.clear(args.key, args.route)
        for key, route in released:
            print(f"released {route} for {key}")
        print(f"{len(released)} route(s) released in {f.path}")
    else:
        if not args.key or not args.route:
            print("toktier quarantine add needs --key (full build key) and --route", file=sys.stderr)
            return 2
        import time

        f.add(args.key, args.route, {"reason": args.reason, "since": time.time()})
        print(f"quarantined {args.route} for {args.key} in {f.path}")
    return 0


def run_metrics(args: argparse.Namespace) -> int:
    from toktier_backend.serving.metrics import main

    argv = ["--host", args.host, "--port", str(args.port)]
    if args.multiproc_dir:
        argv += ["--multiproc-dir", args.multiproc_dir]
    return main(argv)


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
    p.add_argument("--toktier-metrics-port", type=int, default=8003,
                   help="port of the aggregated toktier_* Prometheus metrics (default 8003, next to Triton's "
                        "--metrics-port; 0 picks a free port, -1 serves none)")
    p.add_argument("--tokenizer-sha256", default=None, help="refuse to serve a tokenizer file with another sha256")
    p.add_argument("--session-budget-bytes", type=int, default=None,
                   help="byte budget of each instance's sessions, LRU-evicted beyond it (default 1 GiB; 0 = unbounded)")
    p.add_argument("--verifier-rate", type=float, default=None,
                   help="share of replies the shadow verifier re-checks with the HF reference (default 0.01)")
    p.add_argument("--verifier-first-n", type=int, default=None,
                   help="replies always checked per tokenizer/engine build (default 32)")
    p.add_argument("--verifier-debug", action="store_true", help="log the differing text of a mismatch (default redacted)")
    p.add_argument("--quarantine-file", default=None, help="quarantine file shared by the instances (see toktier quarantine)")
    p.add_argument("--chat-template", default=None,
                   help="chat template of MESSAGES requests to toktier_session: a .jinja file, or a .json holding "
                        "chat_template (default: the one beside the tokenizer, if any)")
    p.add_argument("--pytriton", action="store_true", help="serve the same handler through PyTriton instead")
    p.add_argument("--tritonserver", default=None, help="another tritonserver binary with its own Python backend")
    p.add_argument("--encode-gpu-instances", type=int, default=0,
                   help="toktier_encode GPU instances per GPU, beside one CPU instance that takes the overflow "
                        "(default 0: CPU only; needs the [gpu] extra and a CUDA device, else they serve from the CPU)")
    p.add_argument("--gpu-engine", choices=("auto", "off"), default=None,
                   help="GPU instances: 'auto' (GPU engine if it loads and passes the canary) or 'off'")
    p.add_argument("--gpu-crossover-chars", type=int, default=None,
                   help="GPU instances: texts of at least this many chars go to the GPU (default 65536)")
    p.add_argument("--gpu-max-queue", type=int, default=None,
                   help="GPU instances: requests that may wait for the device before the rest go to the CPU (default 4)")
    p.add_argument("--with-ensemble", action="store_true",
                   help="also serve the TensorRT-LLM ensemble example (ensemble -> preprocessing -> a CPU tensorrt_llm stand-in)")


def run_serve(args: argparse.Namespace) -> int:
    from toktier_backend.deploy.server import serve

    if args.chat_template is not None:
        from toktier_backend.chat.template import load_chat_template
        from toktier_backend.errors import ToktierError

        try:  # refused here, with the file's name, rather than by every model instance at load
            load_chat_template(None, _template_file(args.chat_template))
        except (ToktierError, OSError) as e:
            print(f"toktier serve: --chat-template: {e}", file=sys.stderr)  # (the error names the file)
            return 2

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
        toktier_metrics_port=None if args.toktier_metrics_port < 0 else args.toktier_metrics_port,
        parameters=_parameters(args),
        with_ensemble=args.with_ensemble,
        encode_gpu_instances=args.encode_gpu_instances,
    )


def _parameters(args: argparse.Namespace) -> dict[str, str]:
    """Model parameters set on the command line (the others keep config.pbtxt's values)."""
    out: dict[str, str] = {}
    for key, value in (
        ("tokenizer_sha256", args.tokenizer_sha256),
        ("session_budget_bytes", args.session_budget_bytes),
        ("verifier_rate", args.verifier_rate),
        ("verifier_first_n", args.verifier_first_n),
        ("verifier_debug", "true" if args.verifier_debug else None),
        ("quarantine_file", args.quarantine_file),
        ("gpu_engine", args.gpu_engine),
        ("gpu_crossover_chars", args.gpu_crossover_chars),
        ("gpu_max_queue", args.gpu_max_queue),
        ("chat_template", _template_file(args.chat_template) if args.chat_template else None),
    ):
        if value is not None:
            out[key] = str(value)
    return out


def _template_file(path: str) -> str:
    """The absolute path of a template file (the models load it from the server's working directory)."""
    from pathlib import Path

    return str(Path(path).expanduser().resolve())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="toktier")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
