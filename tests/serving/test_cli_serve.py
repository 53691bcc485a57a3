"""``toktier serve`` as a user runs it: a subprocess that serves until SIGTERM, then stops cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from .conftest import BUNDLED, REPO, _need_serving_deps, hf_ids

pytestmark = pytest.mark.serving


CHAT_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


def test_serve_until_sigterm(tmp_path):
    """Also ``--chat-template FILE``: the bundled GPT-2 file has no template; a MESSAGES request renders with
    the given one (its text written out here by hand) and encodes as HF does."""
    _need_serving_deps()
    import json

    import tritonclient.http as httpclient

    from toktier_backend.deploy.server import free_ports

    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    http, grpc, metrics = free_ports(3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "toktier_backend.cli", "serve", "--tokenizer", str(BUNDLED),
         "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
         "--chat-template", str(template)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        deadline = time.monotonic() + 240
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if "ready" in line or line == "" and proc.poll() is not None:
                break
        assert "ready" in line, f"serve did not get ready (exit {proc.poll()})"
        triton_pid = int(re.search(r"tritonserver pid (\d+)", line).group(1))
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
        assert client.is_server_ready()
        x = httpclient.InferInput("TEXT", [1, 1], "BYTES")
        x.set_data_from_numpy(np.array([[b"hello world"]], dtype=object))
        r = client.infer("toktier_session", [x], sequence_id=1, sequence_start=True, sequence_end=True)
        assert r.as_numpy("INPUT_ID").reshape(-1).tolist() == hf_ids("bundled", "hello world")
        msgs = [{"role": "user", "content": "list the files"}, {"role": "tool", "content": "a.py b.py"}]
        inputs = []
        for name, value, dtype in (("MESSAGES", json.dumps(msgs).encode(), "BYTES"),
                                   ("ADD_GENERATION_PROMPT", True, "BOOL")):
            x = httpclient.InferInput(name, [1, 1], dtype)
            x.set_data_from_numpy(np.array([[value]], dtype=object if dtype == "BYTES" else np.bool_))
            inputs.append(x)
        r = client.infer("toktier_session", inputs, sequence_id=2, sequence_start=True, sequence_end=True)
        text = "<user>list the files\n<tool>a.py b.py\n<assistant>"
        assert r.as_numpy("INPUT_ID").reshape(-1).tolist() == hf_ids("bundled", text, add_special_tokens=False)
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(ProcessLookupError):  # tritonserver is gone too
            for _ in range(50):
                os.kill(triton_pid, 0)
                time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()



def test_serve_refuses_a_chat_template_it_cannot_read(tmp_path):
    """A missing ``--chat-template``, or a .json without ``chat_template``, stops ``toktier serve`` before any
    server starts, naming the file."""
    missing = tmp_path / "nope.jinja"
    out = subprocess.run([sys.executable, "-m", "toktier_backend.cli", "serve", "--tokenizer", str(BUNDLED),
                          "--chat-template", str(missing)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "nope.jinja" in out.stderr, out.stderr
    no_template = tmp_path / "tokenizer.json"  # a .json without chat_template
    no_template.write_text('{"model": {}}')
    out = subprocess.run([sys.executable, "-m", "toktier_backend.cli", "serve", "--tokenizer", str(BUNDLED),
                          "--chat-template", str(no_template)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no 'chat_template' in this file" in out.stderr, out.stderr
