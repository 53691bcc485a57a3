"""``toktier demo`` (the main job) end to end: it starts its own tritonserver, replays a real SWE-agent
trajectory through the client, checks every served reply against the HF reference, and always stops the
server. Also: exit code 1 on a mismatch, 2 on a server failure, 130 on Ctrl-C."""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from toktier_backend.corpus import load_turns, trajectory_files

from .conftest import BUNDLED, REPO, _need_serving_deps

pytestmark = pytest.mark.serving


def _one_session(tmp_path: Path) -> Path:
    """A sessions folder holding the smallest bundled trajectory."""
    src = min(trajectory_files(None), key=lambda f: f.stat().st_size)
    folder = tmp_path / "sessions"
    folder.mkdir()
    shutil.copy(src, folder / src.name)
    return folder


def _demo_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "toktier_backend.cli", "demo", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "COLUMNS": "220"}  # the whole table on one line per row


def _gone(pid: int, wait_s: float = 10.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _triton_children() -> list[int]:
    """tritonserver processes whose parent is this test process."""
    me, found = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
            comm = fields[0].split("(", 1)[1]
            ppid = int(fields[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == me and comm.startswith("tritonserver"):
            found.append(int(stat.parent.name))
    return found


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_demo_served_one_session(tmp_path, protocol):
    """The CLI as a user runs it, on one bundled trajectory over a 100K-char base context: the final text's
    length and id count in the table are HF's, 0 mismatches, exit 0, server stopped; over gRPC the
    10K-to-1M-char sweep runs and writes the PNG."""
    _need_serving_deps()
    import tokenizers

    from toktier_backend.demo import SWEEP_CHARS, SWEEP_TURNS, base_context

    sessions = _one_session(tmp_path)
    turns = load_turns(next(sessions.glob("*.traj")))
    n_turns = len(turns)
    plot = tmp_path / "out" / "latency.png"
    cmd = _demo_cmd("--sessions", str(sessions), "--tokenizer", str(BUNDLED), "--protocol", protocol,
                    "--context-chars", "100000", *(("--plot", str(plot)) if protocol == "grpc" else ("--no-plot",)))
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "0 mismatches against the HF reference" in out, out
    assert "MISMATCH" not in out and "server failure" not in out, out
    assert "served session repair vs served full re-encode on a " in out, out

    # the replayed text is base + turn; its length and HF's id count are in the session's row
    base = base_context(100_000)
    assert 80_000 < len(base) <= 100_000 and base.endswith("<|im_end|>\n")
    assert f"each on a base context of {len(base):,} chars" in out, out
    final = base + turns[-1]
    want = tokenizers.Tokenizer.from_file(str(BUNDLED)).encode(final).ids
    row = next(x for x in out.splitlines() if f" {len(final):,} " in x)
    assert f" {len(want):,} " in row, (len(want), row)

    # every turn went through all three served modes and HF, and the session repaired by appending
    for label in ("repair full-text:", "repair delta+patch:", "full re-encode:"):
        line = next(x for x in out.splitlines() if x.startswith(label))
        assert f"n={n_turns - 1} " in line and line.rstrip().endswith("mismatches 0"), line
    hf_line = next(x for x in out.splitlines() if x.startswith("HF encode:"))
    assert f"n={n_turns - 1} " in hf_line, hf_line
    assert f"routes append:{n_turns - 1} full:1" in out, out
    assert "toktier_encode_fast" in out, out  # the plain stateless model is the full re-encode
    sweep_replies = len(SWEEP_CHARS) * (1 + SWEEP_TURNS) * 3 if protocol == "grpc" else 0  # (growth + turns) x modes
    warm = 3 * 3
    assert f"({3 * n_turns + warm + sweep_replies} served replies checked, {warm} of them warm-up)" in out, out
    if protocol == "grpc":
        assert f"one session grown from {SWEEP_CHARS[0]:,} to " in out, out
        assert f"plot: {plot}" in out, out
        data = plot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    else:
        assert "plot:" not in out and not plot.exists()
    assert "ready in" in out and f": {protocol} 127.0.0.1:" in out, out
    triton_pid = int(re.search(r"tritonserver pid (\d+) ready", out).group(1))
    assert "tritonserver stopped (exit code 0)" in out, out
    assert _gone(triton_pid)


def test_base_context_is_whole_messages_of_the_bundled_sessions():
    """The base context: the bundled trajectories' final texts, concatenated and repeated, cut back to the end
    of a message, at most the size asked."""
    from toktier_backend.demo import base_context

    finals = "".join(load_turns(f)[-1] for f in trajectory_files(None))
    for n in (50_000, 400_000):
        b = base_context(n)
        assert len(b) <= n and n - len(b) < 20_000 and b.endswith("<|im_end|>\n")
        assert b == (finals * (n // len(finals) + 1))[: len(b)]
    assert base_context(0) == ""


def test_demo_counts_mismatches(native, monkeypatch):
    """A reference that disagrees with the server on one turn: the demo says so and returns exit code 1.
    (Runs against the shared test server with ``url=``; the reference is the only thing changed.)"""
    import tokenizers
    from rich.console import Console

    from toktier_backend.demo import EXIT_MISMATCH, run_served

    real = tokenizers.Tokenizer

    class Encoding:
        def __init__(self, ids):
            self.ids = ids

    class WrongOnLongTexts:
        """HF reference, except for texts over 5,000 chars: their last id is off by one."""

        def __init__(self, path):
            self._tok = real.from_file(path)

        @classmethod
        def from_file(cls, path):
            return cls(path)

        def encode(self, text):
            ids = list(self._tok.encode(text).ids)
            if len(text) > 5000:
                ids[-1] += 1
            return Encoding(ids)

    monkeypatch.setattr(tokenizers, "Tokenizer", WrongOnLongTexts)
    buf = io.StringIO()
    folder = min(trajectory_files(None), key=lambda f: f.stat().st_size).parent
    code = run_served(str(BUNDLED), str(folder), url=native.grpc_url, console=Console(file=buf, width=220),
                      context_chars=20_000, plot=None)
    out = buf.getvalue()
    assert code == EXIT_MISMATCH, out
    assert "MISMATCHES against the HF reference" in out, out


def test_demo_bad_sessions_folder(tmp_path):
    """No trajectories: exit code 2 before any server starts."""
    from rich.console import Console

    from toktier_backend.demo import EXIT_FAILURE, run_served

    buf = io.StringIO()
    assert run_served(None, str(tmp_path), console=Console(file=buf, width=200)) == EXIT_FAILURE
    assert "no *.traj files" in buf.getvalue()


def test_demo_server_not_ready_is_a_failure_and_stopped(tmp_path):
    """The server does not get ready in time: exit code 2, and no tritonserver is left behind."""
    _need_serving_deps()
    from rich.console import Console

    from toktier_backend.demo import EXIT_FAILURE, run_served

    before = set(_triton_children())  # e.g. the session-scoped test servers
    buf = io.StringIO()
    code = run_served(None, str(_one_session(tmp_path)), console=Console(file=buf, width=200), ready_timeout_s=0)
    assert code == EXIT_FAILURE, buf.getvalue()
    assert "server failure" in buf.getvalue()
    assert set(_triton_children()) <= before


def test_demo_ctrl_c_stops_the_server(tmp_path):
    """SIGINT while the demo replays: exit code 130 and tritonserver is gone."""
    _need_serving_deps()
    proc = subprocess.Popen(_demo_cmd("--repeat", "500"), cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out = ""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            out += line
            if "ready in" in line or (line == "" and proc.poll() is not None):
                break
        m = re.search(r"tritonserver pid (\d+) ready", out)
        assert m, f"demo did not get the server ready (exit {proc.poll()}):\n{out}"
        time.sleep(1.0)  # into the replay (500 passes take far longer)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        out += rest
        assert proc.returncode == 130, out
        assert "interrupted" in out and "tritonserver stopped" in out, out
        assert _gone(int(m.group(1)))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
