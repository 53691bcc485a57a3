"""Fleet pieces without servers: the nginx configuration (checked by ``nginx -t``), the compose copy of it,
the routing key, the client's session header and sequence IDs, and the missing-nginx message."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from toktier_backend.deploy import fleet as fl
from toktier_backend.deploy.fleet import NGINX_INSTALL, SESSION_HEADER, Upstream, nginx_config, routing_key

from .conftest import require_nginx

REPO_CONF = fl.Path(__file__).resolve().parents[2] / "deploy" / "nginx" / "nginx.conf"


def test_routing_key():
    assert routing_key("tt-1-2-ab") == "tt-1-2-ab" and routing_key(17) == routing_key("17") == "17"
    for odd in ("é", "a\nb", " pad", "x" * 201, ""):
        key = routing_key(odd)
        assert key.startswith("sha256:") and len(key) == 39 and key.isascii()
    assert routing_key("é") != routing_key("e")


def test_nginx_config_is_valid(tmp_path):
    """The generated configuration passes ``nginx -t`` and routes both protocols by the session header."""
    nginx = require_nginx()
    ups = [Upstream("127.0.0.1", 18000 + i, 18100 + i) for i in range(3)]
    (tmp_path / "tmp").mkdir()
    text = nginx_config(ups, http_port=18200, grpc_port=18201, prefix=tmp_path)
    directives = [ln.split("#")[0] for ln in text.splitlines()]
    assert not any("daemon" in d for d in directives)  # run with -g 'daemon off;' (as the nginx image does)
    assert text.count("hash $http_x_toktier_session consistent;") == 2
    assert "grpc_pass grpc://toktier_grpc;" in text and "listen 127.0.0.1:18201 http2;" in text
    assert "non_idempotent" not in text  # a request a replica received is never replayed on another
    for u in ups:
        assert f"server {u.grpc} " in text and f"server {u.http} " in text
    conf = tmp_path / "nginx.conf"
    conf.write_text(text)
    r = subprocess.run([nginx, "-t", "-p", f"{tmp_path}/", "-e", str(tmp_path / "error.log"), "-c", str(conf),
                        "-g", "daemon off;"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_compose_config_is_generated():
    """deploy/nginx/nginx.conf is exactly what ``toktier fleet --print-nginx-config`` prints."""
    want = fl.compose_nginx_config()
    assert REPO_CONF.read_text() == want, (
        "deploy/nginx/nginx.conf is stale: python -m toktier_backend.deploy.fleet fleet --print-nginx-config "
        "> deploy/nginx/nginx.conf")
    for host in ("triton", "triton-2", "triton-3"):
        assert f"server {host}:8001 " in want and f"server {host}:8000 " in want


def test_cli_prints_config(capsys):
    from toktier_backend.cli import main

    assert main(["fleet", "--print-nginx-config", "--upstream", "10.0.0.5:8000:8001", "--upstream",
                 "10.0.0.6:8000:8001", "--host", "0.0.0.0"]) == 0
    out = capsys.readouterr().out
    assert "server 10.0.0.6:8001 max_fails=1" in out and "listen 0.0.0.0:8001 http2;" in out


def test_missing_nginx_names_the_install_command(monkeypatch):
    monkeypatch.setattr(fl.shutil, "which", lambda name: None)
    monkeypatch.setattr(fl, "_NGINX_PATHS", ())
    with pytest.raises(FileNotFoundError, match="apt-get install -y nginx-light"):
        fl.find_nginx()
    assert "nginx-light" in NGINX_INSTALL
    with pytest.raises(FileNotFoundError, match="apt-get install"):
        fl.Fleet("default", 1).start()


class _Result:
    def __init__(self, ids, keep):
        self.t = {"INPUT_ID": np.array([ids[keep:]], dtype=np.int32), "REQUEST_INPUT_LEN": np.array([[len(ids)]]),
                  "KEEP": np.array([[keep]]), "ROUTE": np.array([[b"new" if keep == 0 else b"append"]], dtype=object)}

    def as_numpy(self, name):
        return self.t[name]


class _FakeTriton:
    """Holds sessions per sequence ID like one replica; ``forget()`` makes it a replica that never saw them."""

    def __init__(self):
        self.held, self.calls = {}, []

    def infer(self, model, inputs, **kw):
        self.calls.append(kw)
        text = inputs[0]._raw.decode()
        mode = inputs[1]._raw.decode()
        seq = kw["sequence_id"]
        if kw.get("sequence_start"):
            self.held[seq] = ""
        elif seq not in self.held:
            raise RuntimeError("[StatusCode.INVALID_ARGUMENT] must specify the START flag on the first request")
        old = self.held[seq]
        new = old + text if mode == "delta" else text
        self.held[seq] = new
        ids = [ord(ch) for ch in new]
        keep = 0 if kw.get("sequence_start") else len(old)
        return _Result(ids, keep)

    def close(self):
        pass


def test_client_header_and_new_sequence_id_per_start(monkeypatch):
    """Every request carries the session header; a re-open after "START required" uses a new sequence ID,
    so the replica that still holds the old one (the session moved away and back) never serves it."""
    from toktier_backend import client as cl

    class _Input:
        def __init__(self, name, shape, dtype):
            self.name = name

        def set_data_from_numpy(self, v):
            self._raw = v.reshape(-1)[0] if v.dtype == object else b""

    class _Output:
        def __init__(self, name):
            pass

    class _Mod:
        InferInput, InferRequestedOutput = _Input, _Output

    fake = _FakeTriton()
    c = cl.SessionClient("proxy:8001", client=fake, session_id="s1")
    c._mod = _Mod
    assert c.open("ab").tolist() == [97, 98] and c.sequence_id == "s1"
    assert c.append("c").tolist() == [97, 98, 99]
    assert all(k["headers"] == {SESSION_HEADER: "s1"} for k in fake.calls)
    other = _FakeTriton()  # the proxy moved the session to a replica that never saw it
    c._client = other
    assert c.append("d").tolist() == [97, 98, 99, 100] and c.reopens == 1 and c.sequence_id == "s1#1"
    c._client = fake  # ... and back: "s1" there is stale ("abc"), but the client no longer uses it
    assert c.append("e").tolist() == [97, 98, 99, 100, 101] and c.reopens == 2 and c.sequence_id == "s1#2"
    assert fake.held["s1"] == "abc" and fake.held["s1#2"] == "abcde"
    assert {k["headers"][SESSION_HEADER] for k in fake.calls + other.calls} == {"s1"}
