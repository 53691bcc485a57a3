"""``toktier fleet`` as a user runs it: two replicas and nginx on loopback, one session through each
protocol, then SIGTERM stops everything (exit code 0, no process left)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from toktier_backend.client import SessionClient
from toktier_backend.deploy.fleet import _port_open
from toktier_backend.deploy.server import free_ports

from ..serving.conftest import BUNDLED, _need_serving_deps, hf_ids
from .conftest import require_nginx

pytestmark = pytest.mark.serving


def test_fleet_command_serves_and_stops(tmp_path):
    _need_serving_deps()
    require_nginx()
    http, grpc = free_ports(2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "toktier_backend.cli", "fleet", "--replicas", "2", "--tokenizer", str(BUNDLED),
         "--http-port", str(http), "--grpc-port", str(grpc), "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while "replica 1:" not in "".join(lines):  # the ready line, then one line per replica
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        out = "".join(lines)
        assert f"HTTP 127.0.0.1:{http}" in out and f"gRPC 127.0.0.1:{grpc}" in out
        assert "replica 0:" in out and "replica 1:" in out
        text = "hello world, a fleet of tokenizers"
        for protocol, port in (("grpc", grpc), ("http", http)):
            with SessionClient(f"127.0.0.1:{port}", protocol=protocol) as c:
                assert c.open("hello").tolist() == hf_ids("bundled", "hello")
                assert c.append(text[5:]).tolist() == hf_ids("bundled", text) and c.last.keep > 0
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == 0
        reader.join(10)
        assert "stopping" in "".join(lines), "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    pairs = re.findall(r"replica \d: HTTP 127\.0\.0\.1:(\d+)  gRPC 127\.0\.0\.1:(\d+)", out)
    ports = [http, grpc] + [int(x) for pair in pairs for x in pair]
    assert len(ports) == 6
    assert not any(_port_open("127.0.0.1", p) for p in ports)  # nginx and both tritonservers are gone
