"""A Dynamo worker for the tests: takes token ids (``ModelInput.Tokens``), records them, replies with a few.

Registered with Dynamo's own runtime (``register_model`` + ``serve_endpoint``, ai-dynamo 1.6.1), so the
frontend routes to it exactly as to a real engine. Each request's ``token_ids`` (and its stop conditions) are
appended as one JSON line to ``--record`` before the reply, so a test reads what the engine received. The
reply is ``--reply`` (a text, encoded once with the model's ``tokenizer.json``), one id per response, the
last with ``finish_reason: "stop"``.

Usage: ``python tests/faces/dynamo_echo_worker.py --model-path DIR --model-name NAME --record FILE``
(discovery / planes from the ``DYN_*`` environment, as every Dynamo process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import uvloop
from tokenizers import Tokenizer

from dynamo.llm import ModelInput, ModelType, WorkerType, register_model
from dynamo.runtime import DistributedRuntime


async def main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, os.environ.get("DYN_DISCOVERY_BACKEND", "file"),
                                 os.environ.get("DYN_REQUEST_PLANE", "tcp"),
                                 event_plane=os.environ.get("DYN_EVENT_PLANE", "zmq"))
    reply = Tokenizer.from_file(os.path.join(args.model_path, "tokenizer.json")).encode(
        args.reply, add_special_tokens=False).ids
    endpoint = runtime.endpoint(f"{args.namespace}.echo.generate")
    record = open(args.record, "a", encoding="utf-8")

    async def generate(request, context=None):
        record.write(json.dumps({"token_ids": list(request.get("token_ids") or []),
                                 "stop_conditions": request.get("stop_conditions")}) + "\n")
        record.flush()
        for i, t in enumerate(reply):
            yield {"token_ids": [t], "finish_reason": "stop" if i == len(reply) - 1 else None}

    await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, endpoint, args.model_path,
                         args.model_name, worker_type=WorkerType.Aggregated)
    print(f"echo worker ready: {args.model_name}", flush=True)
    await endpoint.serve_endpoint(generate)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--model-name", required=True)
    ap.add_argument("--record", required=True)
    ap.add_argument("--namespace", default="echo")
    ap.add_argument("--reply", default="Hello from the echo worker.")
    uvloop.run(main(ap.parse_args()))
