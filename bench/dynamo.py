"""Chat turns through Dynamo 1.6.1's frontend: the toktier chat processor vs the stock Rust preprocessor.

One run starts ``dynamo.mocker`` (qwen3's tokenizer, prefix caching, high speedup so the engine is not what
is timed) and three frontends discovering it on loopback: ``toktier dynamo`` (ours), ``dynamo.frontend
--tokenizer default`` and ``dynamo.frontend --tokenizer fastokens``. Each sends the same agent conversation,
grown to ~100K and ~1M chars and resent turn by turn with ~1.5K chars appended (as an agent does), with
``max_tokens=1``, streaming:

- TTFT: request sent -> first SSE data chunk, p50 / p90 over ``--turns`` turns per size (ms);
- throughput: requests/s at ``--concurrency`` parallel conversations of the 100K size, ``--rps-requests``
  requests in all.

Exactness first: every reply's ``usage.prompt_tokens`` must equal the HF count
(``transformers`` render + ``tokenizers`` encode, ``add_special_tokens=False``) on every frontend.

Usage: ``python bench/dynamo.py [--turns 8] [--concurrency 4] [--rps-requests 24] [--json out.json]``
(needs ``deploy/install_dynamo.sh`` and ``../shared``).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TOKTIER_SHARED", REPO.parent / "shared"))
MODEL = "qwen3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir(tmp: Path) -> Path:
    d = tmp / "model"
    d.mkdir()
    (d / "tokenizer.json").symlink_to(SHARED / "tokenizers" / MODEL / "tokenizer.json")
    (d / "tokenizer_config.json").symlink_to(SHARED / "chat_templates" / MODEL / "tokenizer_config.json")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "max_position_embeddings": 1 << 22, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 1,
        "num_key_value_heads": 1, "eos_token_id": 151645}))
    return d


def conversation(n_chars: int) -> list[dict]:
    """SWE-agent messages (tool -> user), cycled through the corpus until the contents reach ``n_chars``."""
    msgs: list[dict] = []
    total = 0
    files = sorted((SHARED / "corpus" / "swe-agent").glob("*.traj"))
    while total < n_chars:
        for f in files:
            for m in json.loads(f.read_text())["history"]:
                c = m.get("content")
                c = c if isinstance(c, str) else json.dumps(c)
                role = m.get("role") if m.get("role") in ("user", "assistant") else "user"
                if not msgs:
                    role = "system"
                msgs.append({"role": role, "content": c})
                total += len(c)
                if total >= n_chars:
                    return msgs
    return msgs


def post_stream(port: int, body: dict, timeout: float = 600.0) -> tuple[float, int]:
    """(seconds to the first data chunk, usage.prompt_tokens)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", method="POST",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, prompt_tokens = None, -1
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            ev = json.loads(line[5:])
            if ev.get("usage"):
                prompt_tokens = ev["usage"]["prompt_tokens"]
    return ttft, prompt_tokens


def wait_ready(port: int, procs, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"a process exited ({p.args[:4]}): see its log")
        try:
            post_stream(port, body([{"role": "user", "content": "ping"}], "ready"), timeout=10)
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"frontend :{port} not ready")


def body(msgs: list[dict], key: str) -> dict:
    return {"model": MODEL, "messages": msgs, "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True}, "user": key}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100000,1000000", help="conversation sizes in chars")
    ap.add_argument("--turns", type=int, default=8, help="timed turns per size and frontend")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rps-requests", type=int, default=24)
    ap.add_argument("--json", default=None)
    ap.add_argument("--ours-args", default="", help="extra flags for `toktier dynamo`, e.g. '--toktier-verifier-first-n 0'")
    a = ap.parse_args()
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix="toktier_bench_dynamo_"))
    mdir = model_dir(tmp)
    hf_tok = AutoTokenizer.from_pretrained(str(mdir))
    hf = Tokenizer.from_file(str(mdir / "tokenizer.json"))

    def hf_count(msgs):
        return len(hf.encode(hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                             add_special_tokens=False).ids)

    env = {**os.environ, "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(tmp / "kv"), "DYN_REQUEST_PLANE": "tcp",
           "DYN_EVENT_PLANE": "zmq", "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
           "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1", "HF_HUB_OFFLINE": "1",
           "DYN_LOG": "warn", "PYTHONPATH": str(REPO)}
    procs: list[subprocess.Popen] = []

    def start(args, name):
        f = open(tmp / f"{name}.log", "ab")
        p = subprocess.Popen(args, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        return p

    ports = {}
    try:
        start([sys.executable, "-m", "dynamo.mocker", "--model-path", str(mdir), "--model-name", MODEL,
               "--speedup-ratio", "100000", "--enable-prefix-caching", "--block-size", "16",
               "--num-gpu-blocks-override", "400000", "--max-model-len", str(1 << 22),
               "--max-num-batched-tokens", str(1 << 22)], "mocker")
        fe = [("toktier", [sys.executable, "-m", "toktier_backend.faces.dynamo", "--toktier-metrics-port", "0", *a.ours_args.split()]),
              ("default", [sys.executable, "-m", "dynamo.frontend", "--tokenizer", "default"]),
              ("fastokens", [sys.executable, "-m", "dynamo.frontend", "--tokenizer", "fastokens"])]
        for name, args in fe:
            ports[name] = free_port()
            start(args + ["--http-host", "127.0.0.1", "--http-port", str(ports[name]), "--router-mode", "kv",
                          "--kv-cache-block-size", "16"], name)
        for name in ports:
            wait_ready(ports[name], procs)
        sizes = [int(s) for s in a.sizes.split(",")]
        base = {n: conversation(n) for n in sizes}
        turn_text = conversation(1600)[-1]["content"][:1500]
        rows, out = [], {"turns": a.turns, "concurrency": a.concurrency, "results": {}}
        for n in sizes:
            # turn k: the conversation + k user turns of ~1.5K chars; one untimed warm-up turn opens the session
            turns = [base[n] + [{"role": "user", "content": f"turn 0: {turn_text}"}]]
            for k in range(1, a.turns + 1):
                turns.append(turns[-1] + [{"role": "assistant", "content": "ok"},
                                          {"role": "user", "content": f"turn {k}: {turn_text}"}])
            want = [hf_count(t) for t in turns]
            res = {}
            for name, port in ports.items():
                ttfts = []
                for k, t in enumerate(turns):
                    ttft, pt = post_stream(port, body(t, f"{name}-{n}"))
                    if pt != want[k]:
                        raise SystemExit(f"{name} {n} chars turn {k}: prompt_tokens {pt} != HF {want[k]}")
                    if k:
                        ttfts.append(ttft * 1e3)
                res[name] = (float(np.percentile(ttfts, 50)), float(np.percentile(ttfts, 90)))
            out["results"][f"ttft_{n}"] = res
            rows.append((f"TTFT {n // 1000}K chars (ms)", res))
        # throughput: concurrency conversations of the first size, each resent with a growing tail
        n = sizes[0]
        rps = {}
        for name, port in ports.items():
            def one(i, name=name, port=port):
                conv = base[n] + [{"role": "user", "content": f"conv {i % a.concurrency} req {i}: {turn_text}"}]
                return post_stream(port, body(conv, f"{name}-rps-{i % a.concurrency}"))
            with cf.ThreadPoolExecutor(a.concurrency) as ex:
                list(ex.map(one, range(a.concurrency)))  # warm-up
                t0 = time.perf_counter()
                list(ex.map(one, range(a.rps_requests)))
                rps[name] = a.rps_requests / (time.perf_counter() - t0)
        out["results"]["rps"] = rps
        print(f"\nDynamo 1.6.1 frontend + mocker, qwen3, {a.turns} turns per size (n), loopback; p50 / p90\n")
        print(f"| measure | toktier processor | stock --tokenizer default | stock --tokenizer fastokens | ratio default/ours |")
        print("|---|---|---|---|---|")
        for label, res in rows:
            r = res["default"][0] / res["toktier"][0]
            print(f"| {label} | {res['toktier'][0]:.1f} / {res['toktier'][1]:.1f} | {res['default'][0]:.1f} / "
                  f"{res['default'][1]:.1f} | {res['fastokens'][0]:.1f} / {res['fastokens'][1]:.1f} | {r:.2f}x |")
        print(f"| req/s, {n // 1000}K chars, concurrency {a.concurrency}, n={a.rps_requests} | {rps['toktier']:.2f} | "
              f"{rps['default']:.2f} | {rps['fastokens']:.2f} | {rps['toktier'] / rps['default']:.2f}x (ours/default) |")
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
        return 0
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait()


if __name__ == "__main__":
    sys.exit(main())
