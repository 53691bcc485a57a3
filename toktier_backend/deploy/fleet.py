"""``toktier fleet``: N ``toktier serve`` replicas behind nginx, routed by session key.

Session state is a cache, never the source of truth (the client holds the text), so scale-out needs only
**session affinity** from an existing L7 proxy, plus exact rebuilds when a session lands on a replica that
lacks it:

- :class:`~toktier_backend.client.SessionClient` sends the session key as the request header
  :data:`SESSION_HEADER` (gRPC metadata / HTTP header) beside the Triton sequence ID;
- nginx routes by it: ``hash $http_x_toktier_session consistent`` in one upstream for gRPC (``grpc_pass``,
  ``http2`` listener) and one for HTTP (``proxy_pass``); requests without the header (``toktier_encode``,
  health) fall back to round-robin;
- a replica that does not hold a sequence answers "must specify the START flag" (Triton's sequence
  batcher) or ``NOT_FOUND`` (a delta for a session its model instance lost), and the client resends the
  whole text it holds: one exact rebuild per moved session. Every START after a session's first uses a new
  sequence ID (``SessionClient.sequence_id``), so a replica still holding an *older* state of a session
  that moved away and back never serves it.

:func:`nginx_config` writes the proxy configuration (also ``deploy/nginx/nginx.conf`` for
``docker compose --profile fleet``); :class:`Nginx` runs nginx as a foreground child with that
configuration in a temp dir (``-p`` prefix, no system service); :class:`Fleet` starts the replicas
(:class:`~toktier_backend.deploy.server.TritonServer`) and nginx on loopback, and adds, kills, restarts
and removes replicas. See ``docs/fleet.md``.

Example::

    >>> from toktier_backend.client import SessionClient
    >>> with Fleet("default", replicas=2, http_port=0, grpc_port=0) as fleet:
    ...     with SessionClient(fleet.grpc_url) as c:
    ...         c.open("hello world").tolist()
    [31373, 995]

Importing this module imports neither Triton nor ``tritonclient`` (the client imports it).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

SESSION_HEADER = "x-toktier-session"
"""Request header (gRPC metadata key) that carries the session key; nginx reads it as ``$http_x_toktier_session``."""

REPLICA_HEADER = "x-toktier-replica"
"""Response header nginx adds: the replica address(es) that served the request (``$upstream_addr``)."""

NGINX_INSTALL = "apt-get install -y nginx-light"
"""How to install nginx on Debian/Ubuntu (any nginx >= 1.13.10 with the http_v2 and grpc modules works)."""


def routing_key(session_id: int | str) -> str:
    """The :data:`SESSION_HEADER` value for a session: ``str(session_id)`` when it is a valid header value
    (printable ASCII, no surrounding spaces, at most 200 chars), else ``"sha256:"`` + 32 hex digits of it.

    ``routing_key(17) == routing_key("17") == "17"``: two sessions sharing a key share a replica, nothing more.
    """
    s = str(session_id)
    if 0 < len(s) <= 200 and s.isascii() and s.isprintable() and s == s.strip():
        return s
    return "sha256:" + hashlib.sha256(s.encode("utf-8", "surrogatepass")).hexdigest()[:32]


# ---------------------------------------------------------------- nginx configuration


@dataclass(frozen=True)
class Upstream:
    """One replica as nginx sees it: ``host`` and its HTTP and gRPC ports."""

    host: str
    http_port: int
    grpc_port: int

    @property
    def http(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"{self.host}:{self.grpc_port}"


def nginx_config(
    upstreams: Sequence[Upstream],
    *,
    listen_host: str = "127.0.0.1",
    http_port: int = 8000,
    grpc_port: int = 8001,
    prefix: str | Path | None = None,
    worker_processes: int | str = 1,
    fail_timeout_s: int = 10,
    generation: int = 0,
    access_log: bool = True,
) -> str:
    """The nginx configuration of a fleet (no ``daemon`` directive: run with ``-g 'daemon off;'``).

    Args:
        upstreams: the replicas, in order. nginx places each on its consistent-hash ring by its address
            (``host:port``): the gRPC and the HTTP ring differ, so a session keeps one protocol (a switch
            costs one exact rebuild), and a replica restarted on the same address gets its keys back.
        listen_host, http_port, grpc_port: the front listeners (HTTP/1.1; gRPC = HTTP/2 cleartext).
        prefix: folder for pid, logs and temp files (local runs); ``None``: nginx's defaults, logs to
            stdout/stderr (the container in ``docker-compose.yml``).
        worker_processes: nginx workers (``1`` leaves the cores to the replicas; ``"auto"``: one per core).
        fail_timeout_s: a replica that refused a connection is skipped for this long (``max_fails=1``),
            then tried again; its sessions meanwhile go to the next replica on the ring.
        generation: reported by ``GET /_toktier/fleet`` on the HTTP listener (which config is live).
        access_log: log ``$msec key upstream status request_time`` per request (``access.log`` in ``prefix``).

    Only requests not yet sent to a replica (connection refused or timed out) are retried on the next one;
    a request a replica received is never replayed (gRPC and Triton's HTTP inference are POSTs, and nginx
    retries those only with ``non_idempotent``, not set here): a replica that dies mid-request fails that
    request (502 / gRPC UNAVAILABLE) and the client's next request resends the whole text.
    """
    if not upstreams:
        raise ValueError("a fleet needs at least one replica")
    p = Path(prefix).resolve() if prefix is not None else None
    hdr = SESSION_HEADER.replace("-", "_")
    servers = lambda kind: "\n".join(  # noqa: E731
        f"        server {getattr(u, kind)} max_fails=1 fail_timeout={fail_timeout_s}s;" for u in upstreams)
    replicas = " ".join(u.grpc for u in upstreams)
    lines = [
        f"# toktier fleet: {len(upstreams)} replica(s) behind nginx, session affinity by the {SESSION_HEADER} header.",
        "# Generated by toktier_backend.deploy.fleet.nginx_config; run with -g 'daemon off;'.",
        f"worker_processes {worker_processes};",
    ]
    if p is not None:
        lines += [f"pid {p / 'nginx.pid'};", f"error_log {p / 'error.log'} warn;", f"lock_file {p / 'nginx.lock'};"]
    else:
        lines += ["error_log /dev/stderr warn;"]
    lines += ["", "events {", "    worker_connections 1024;", "}", "", "http {"]
    if p is not None:
        lines += [f"    {d} {p / 'tmp' / n};" for d, n in (
            ("client_body_temp_path", "body"), ("proxy_temp_path", "proxy"), ("fastcgi_temp_path", "fastcgi"),
            ("uwsgi_temp_path", "uwsgi"), ("scgi_temp_path", "scgi"))]
    log_target = "off" if not access_log else (f"{p / 'access.log'} fleet" if p is not None else "/dev/stdout fleet")
    lines += [
        f"    log_format fleet '$msec $http_{hdr} $upstream_addr $status $request_time';",
        f"    access_log {log_target};",
        "    client_max_body_size 0;          # Triton enforces max_text_bytes",
        "    client_body_buffer_size 1m;",
        "",
        "    # One ring per protocol; requests without the header (toktier_encode, health) go round-robin.",
        "    upstream toktier_grpc {",
        f"        hash $http_{hdr} consistent;",
        servers("grpc"),
        "        keepalive 32;",
        "    }",
        "    upstream toktier_http {",
        f"        hash $http_{hdr} consistent;",
        servers("http"),
        "        keepalive 32;",
        "    }",
        "",
        "    server {  # gRPC: HTTP/2 cleartext",
        f"        listen {listen_host}:{grpc_port} http2;",
        "        location / {",
        "            grpc_pass grpc://toktier_grpc;",
        "            grpc_next_upstream error timeout;   # not sent yet: try the next replica on the ring",
        "            grpc_connect_timeout 2s;",
        "            grpc_read_timeout 300s;",
        "            grpc_send_timeout 300s;",
        f"            add_header {REPLICA_HEADER} $upstream_addr always;",
        "        }",
        "    }",
        "",
        "    server {  # HTTP/REST (KServe v2)",
        f"        listen {listen_host}:{http_port};",
        "        location = /_toktier/fleet {",
        f'            return 200 "generation {generation} replicas {replicas}\\n";',
        "        }",
        "        location / {",
        "            proxy_pass http://toktier_http;",
        "            proxy_http_version 1.1;",
        '            proxy_set_header Connection "";',
        "            proxy_request_buffering off;",
        "            proxy_buffering off;",
        "            proxy_next_upstream error timeout;",
        "            proxy_connect_timeout 2s;",
        "            proxy_read_timeout 300s;",
        "            proxy_send_timeout 300s;",
        f"            add_header {REPLICA_HEADER} $upstream_addr always;",
        "        }",
        "    }",
        "}",
        "",
    ]
    return "\n".join(lines)


def compose_nginx_config() -> str:
    """``deploy/nginx/nginx.conf``: the fleet of ``docker-compose.yml`` (``triton``, ``triton-2``,
    ``triton-3`` on 8000/8001; nginx listening on 8000/8001 in its container)."""
    return nginx_config([Upstream(h, 8000, 8001) for h in ("triton", "triton-2", "triton-3")],
                        listen_host="0.0.0.0", prefix=None, worker_processes="auto")


# ---------------------------------------------------------------- nginx process


_NGINX_PATHS = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx")  # off root's PATH


def find_nginx(binary: str | Path | None = None) -> str:
    """The nginx binary: ``binary``, else ``nginx`` on ``PATH``, else ``/usr/sbin/nginx``.

    Raises:
        FileNotFoundError: none found; the message gives the install command.
    """
    if binary is not None:
        if not Path(binary).is_file():
            raise FileNotFoundError(f"nginx binary {binary} not found")
        return str(binary)
    found = shutil.which("nginx") or next((p for p in _NGINX_PATHS if Path(p).is_file()), None)
    if found is None:
        raise FileNotFoundError(
            f"nginx is not installed: the fleet routes sessions through it. Install it with: {NGINX_INSTALL} "
            f"(as root; apt-get update first on a fresh machine)")
    return found


def _port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class Nginx:
    """nginx as a foreground child process with a generated configuration in a temp dir.

    Args:
        upstreams: the replicas.
        host, http_port, grpc_port: the front listeners (``0`` picks free ports).
        binary: the nginx binary (default :func:`find_nginx`).
        worker_processes, fail_timeout_s, access_log: see :func:`nginx_config`.
    """

    def __init__(self, upstreams: Sequence[Upstream], *, host: str = "127.0.0.1", http_port: int = 8000,
                 grpc_port: int = 8001, binary: str | Path | None = None, worker_processes: int | str = 1,
                 fail_timeout_s: int = 10, access_log: bool = True):
        from toktier_backend.deploy.server import free_ports

        ports = free_ports(2, host)
        self.host = host
        self.http_port = http_port or ports[0]
        self.grpc_port = grpc_port or ports[1]
        self.binary = find_nginx(binary)
        self.upstreams = list(upstreams)
        self.worker_processes = worker_processes
        self.fail_timeout_s = fail_timeout_s
        self.access_log = access_log
        self.generation = 0
        self.prefix: Path | None = None
        self.process: subprocess.Popen | None = None

    @property
    def config_path(self) -> Path:
        assert self.prefix is not None
        return self.prefix / "nginx.conf"

    @property
    def access_log_path(self) -> Path | None:
        return None if self.prefix is None or not self.access_log else self.prefix / "access.log"

    @property
    def error_log_path(self) -> Path | None:
        return None if self.prefix is None else self.prefix / "error.log"

    def _write(self) -> None:
        self.config_path.write_text(nginx_config(
            self.upstreams, listen_host=self.host, http_port=self.http_port, grpc_port=self.grpc_port,
            prefix=self.prefix, worker_processes=self.worker_processes, fail_timeout_s=self.fail_timeout_s,
            generation=self.generation, access_log=self.access_log))

    def _args(self) -> list[str]:
        return [self.binary, "-p", f"{self.prefix}/", "-e", str(self.error_log_path), "-c", str(self.config_path),
                "-g", "daemon off;"]

    def test_config(self) -> None:
        """``nginx -t`` on the current configuration.

        Raises:
            RuntimeError: nginx rejects it (the message holds nginx's output).
        """
        r = subprocess.run([*self._args(), "-t", "-q"], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"nginx rejected {self.config_path}:\n{r.stdout}{r.stderr}")

    def start(self, timeout_s: float = 10.0) -> "Nginx":
        """Write the configuration, check it, start nginx and wait until both listeners accept connections.

        Raises:
            RuntimeError: nginx rejected the configuration, exited, or did not listen within ``timeout_s``.
        """
        if self.process is not None:
            raise RuntimeError("nginx already started")
        self.prefix = Path(tempfile.mkdtemp(prefix="toktier-nginx-"))
        # workers may run as another user (nobody, when started as root): they write request-body temp files
        self.prefix.chmod(0o755)
        (self.prefix / "tmp").mkdir()
        (self.prefix / "tmp").chmod(0o1777)
        self._write()
        self.test_config()
        from toktier_backend.deploy.server import _with_parent_death_signal

        self.process = subprocess.Popen(_with_parent_death_signal(self._args()), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not (_port_open(self.host, self.http_port) and _port_open(self.host, self.grpc_port)):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.error_log_path.read_text(errors="replace")[-2000:] if self.error_log_path.exists() else ""
                self.stop()
                raise RuntimeError(f"nginx did not start (listening on {self.host}:{self.http_port}/{self.grpc_port}):\n{tail}")
            time.sleep(0.05)
        return self

    def reload(self, upstreams: Sequence[Upstream], timeout_s: float = 10.0) -> None:
        """Switch to ``upstreams``: rewrite the configuration, check it, SIGHUP the master, and wait until
        new connections are served by the new configuration (old workers finish their requests)."""
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError("nginx is not running")
        old = self.config_path.read_text()
        self.upstreams, self.generation = list(upstreams), self.generation + 1
        self._write()
        try:
            self.test_config()
        except RuntimeError:
            self.config_path.write_text(old)
            raise
        self.process.send_signal(signal.SIGHUP)
        want = f"generation {self.generation} "
        deadline = time.monotonic() + timeout_s
        while want not in self.probe():
            if time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not load generation {self.generation} within {timeout_s:g} s")
            time.sleep(0.05)

    def probe(self) -> str:
        """``GET /_toktier/fleet`` on a new connection: ``"generation G replicas ADDR ..."`` ('' if none)."""
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.http_port}/_toktier/fleet", timeout=2) as r:
                return r.read().decode()
        except (urllib.error.URLError, OSError):
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """Graceful stop (SIGQUIT: finish requests), SIGKILL after ``timeout_s``; removes the temp dir."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGQUIT)
                try:
                    self.process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            self.process = None
        if self.prefix is not None:
            shutil.rmtree(self.prefix, ignore_errors=True)
            self.prefix = None

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


# ---------------------------------------------------------------- the fleet


class Fleet:
    """``replicas`` × :class:`~toktier_backend.deploy.server.TritonServer` (free loopback ports each) and
    :class:`Nginx` in front of them on ``http_port`` / ``grpc_port``.

    Args:
        tokenizer: tokenizer spec served by every replica.
        replicas: how many to start.
        host: address of the replicas and the front.
        http_port, grpc_port: the front (nginx) ports; ``0`` picks free ones.
        log_dir: folder for ``replica<i>.log`` (tritonserver output; ``None``: discarded).
        nginx: the nginx binary (default :func:`find_nginx`).
        nginx_workers, fail_timeout_s, access_log: see :func:`nginx_config`.
        toktier_metrics: run each replica's ``toktier_*`` exporter on a free port.
        **server_kwargs: passed to every ``TritonServer`` (``session_idle_s``, ``max_text_bytes``,
            ``parameters``, ``exit_timeout_s``, ``model_repository``, ``tritonserver``, ...).

    Replica ``i`` keeps its ports for the fleet's life: :meth:`kill_replica` leaves it in nginx's
    configuration (a crash: nginx skips it after one refused connection), :meth:`restart_replica` brings it
    back on the same address (its keys return to it), :meth:`add_replica` and :meth:`remove_replica`
    change the configuration (nginx reloads; with consistent hashing about 1/N of the keys move).

    Raises (``start``):
        FileNotFoundError: nginx or the tritonserver of nvidia-pytriton is missing (install commands given).
        RuntimeError: a replica or nginx failed to start (everything started is stopped).
    """

    def __init__(self, tokenizer: str = "default", replicas: int = 2, *, host: str = "127.0.0.1",
                 http_port: int = 8000, grpc_port: int = 8001, log_dir: str | Path | None = None,
                 nginx: str | Path | None = None, nginx_workers: int | str = 1, fail_timeout_s: int = 10,
                 access_log: bool = True, toktier_metrics: bool = False, **server_kwargs: Any):
        if replicas < 1:
            raise ValueError(f"replicas={replicas}: a fleet needs at least one")
        self.tokenizer = tokenizer
        self.n_initial = replicas
        self.host = host
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.toktier_metrics = toktier_metrics
        self.server_kwargs = server_kwargs
        self.servers: list[Any] = []  # TritonServer per replica index; None once removed
        self.removed: set[int] = set()
        self.nginx = Nginx([], host=host, http_port=http_port, grpc_port=grpc_port, binary=nginx,
                           worker_processes=nginx_workers, fail_timeout_s=fail_timeout_s, access_log=access_log)
        self._ports: list[tuple[int, int, int, int]] = []  # (http, grpc, metrics, toktier metrics) per index

    # urls ------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.nginx.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.nginx.grpc_port}"

    def upstreams(self) -> list[Upstream]:
        """The replicas nginx routes to (all but removed ones; killed ones stay, as after a crash)."""
        return [Upstream(self.host, h, g) for i, (h, g, _, _) in enumerate(self._ports) if i not in self.removed]

    def replica_of(self, upstream_addr: str, protocol: str | None = None) -> int | None:
        """Replica index of an address ``host:port`` as nginx logs it (for a retried request, ``"a, b"``,
        the one that answered); ``protocol`` (``"grpc"``/``"http"``): match only that port. ``None``: not
        a replica (or another protocol's port)."""
        addr = upstream_addr.split(",")[-1].strip()
        for i, (h, g, _, _) in enumerate(self._ports):
            ports = {"http": (h,), "grpc": (g,)}.get(protocol or "", (h, g))
            if addr in {f"{self.host}:{p}" for p in ports}:
                return i
        return None

    def metrics_url(self, i: int) -> str:
        """Triton's metrics endpoint of replica ``i`` (``nv_inference_request_success{model=...}``)."""
        return f"http://{self.host}:{self._ports[i][2]}/metrics"

    # lifecycle -------------------------------------------------------
    def _new_server(self, i: int):
        from toktier_backend.deploy.server import TritonServer

        http, grpc, metrics, tmetrics = self._ports[i]
        log = None if self.log_dir is None else self.log_dir / f"replica{i}.log"
        return TritonServer(self.tokenizer, host=self.host, http_port=http, grpc_port=grpc, metrics_port=metrics,
                            toktier_metrics_port=tmetrics if self.toktier_metrics else None, log_path=log,
                            **self.server_kwargs)

    def _allocate(self) -> int:
        from toktier_backend.deploy.server import free_ports

        taken = {p for ports in self._ports for p in ports} | {self.nginx.http_port, self.nginx.grpc_port}
        while True:
            ports = tuple(free_ports(4, self.host))
            if not taken & set(ports):
                break
        self._ports.append(ports)  # type: ignore[arg-type]
        self.servers.append(None)
        return len(self._ports) - 1

    def _start_replicas(self, indices: Sequence[int], ready_timeout_s: float) -> None:
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        for i in indices:
            self.servers[i] = self._new_server(i).start()
        for i in indices:  # they load in parallel; wait for each
            self.servers[i].wait_ready(ready_timeout_s)

    def start(self, ready_timeout_s: float = 300.0) -> "Fleet":
        """Start the replicas (in parallel), wait until each is ready, then start nginx."""
        find_nginx(self.nginx.binary)
        try:
            indices = [self._allocate() for _ in range(self.n_initial)]
            self._start_replicas(indices, ready_timeout_s)
            self.nginx.upstreams = self.upstreams()
            self.nginx.start()
        except BaseException:
            self.stop()
            raise
        return self

    def add_replica(self, ready_timeout_s: float = 300.0) -> int:
        """Start one more replica, wait until it is ready, then reload nginx with it. Returns its index."""
        i = self._allocate()
        try:
            self._start_replicas([i], ready_timeout_s)
        except BaseException:
            self.removed.add(i)
            raise
        self.nginx.reload(self.upstreams())
        return i

    def kill_replica(self, i: int) -> None:
        """SIGKILL replica ``i``'s tritonserver (a crash: state lost, address left in nginx's configuration),
        then clean up after it (its Python-backend stubs exit on their own; shared-memory regions removed)."""
        server = self.servers[i]
        if server is None or server.process is None:
            return
        grpc = server.grpc_port
        server.process.kill()
        server.process.wait()
        server.stop()
        for f in Path("/dev/shm").glob(f"toktier{os.getpid()}_{grpc}_*"):
            try:
                f.unlink()
            except OSError:
                pass

    def restart_replica(self, i: int, ready_timeout_s: float = 300.0) -> None:
        """Start replica ``i`` again on its address (after :meth:`kill_replica`), empty: the sessions nginx
        routes back to it are rebuilt from the whole text."""
        if self.servers[i] is not None and self.servers[i].is_alive():
            raise RuntimeError(f"replica {i} is running")
        self._start_replicas([i], ready_timeout_s)

    def remove_replica(self, i: int) -> None:
        """Reload nginx without replica ``i`` (about 1/N of the keys move), then stop it gracefully."""
        self.removed.add(i)
        self.nginx.reload(self.upstreams())
        server = self.servers[i]
        if server is not None:
            server.stop()

    def alive(self) -> list[int]:
        """Indices of the replicas whose tritonserver is running."""
        return [i for i, s in enumerate(self.servers) if s is not None and s.is_alive()]

    def stop(self) -> None:
        """Stop nginx, then every replica (in parallel)."""
        self.nginx.stop()
        threads = [threading.Thread(target=s.stop) for s in self.servers if s is not None]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def __enter__(self) -> "Fleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------- the fleet command


def run_fleet(args: argparse.Namespace) -> int:
    """``toktier fleet``: serve until SIGTERM or SIGINT. Exit code 0 on a clean stop, 1 when nginx or every
    replica died, 2 when the fleet could not start."""
    if args.print_nginx_config:
        if args.upstream:
            ups = []
            for spec in args.upstream:
                host, http, grpc = spec.rsplit(":", 2)
                ups.append(Upstream(host, int(http), int(grpc)))
            print(nginx_config(ups, listen_host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                               prefix=None, worker_processes=args.nginx_workers), end="")
        else:
            print(compose_nginx_config(), end="")
        return 0
    kwargs: dict[str, Any] = {}
    if args.session_idle_seconds is not None:
        kwargs["session_idle_s"] = args.session_idle_seconds
    if args.max_text_bytes is not None:
        kwargs["max_text_bytes"] = args.max_text_bytes
    fleet = Fleet(args.tokenizer, args.replicas, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                  log_dir=args.log_dir, nginx=args.nginx, nginx_workers=args.nginx_workers,
                  toktier_metrics=True, **kwargs)
    from toktier_backend.config import stop_on_signals

    with stop_on_signals() as stop:
        return _run_until(fleet, stop, args)


def _run_until(fleet: "Fleet", stop: threading.Event, args) -> int:
    try:
        try:
            fleet.start(args.ready_timeout)
        except (FileNotFoundError, RuntimeError) as e:
            print(f"toktier fleet: {e}", file=sys.stderr, flush=True)
            return 2
        print(f"toktier fleet ({len(fleet.servers)} replicas, tokenizer {args.tokenizer}): ready — "
              f"HTTP {fleet.http_url}  gRPC {fleet.grpc_url}  (nginx pid {fleet.nginx.process.pid}, "
              f"config {fleet.nginx.config_path})", flush=True)
        for i, s in enumerate(fleet.servers):
            print(f"  replica {i}: HTTP {s.http_url}  gRPC {s.grpc_url}  metrics {s.metrics_url}"
                  + (f"  toktier metrics {s.toktier_metrics_url}" if s.toktier_metrics_url else "")
                  + (f"  log {s.log_path}" if s.log_path else ""), flush=True)
        reported: set[int] = set()
        while not stop.wait(0.5):
            if not fleet.nginx.is_alive():
                print("toktier fleet: nginx exited", file=sys.stderr, flush=True)
                return 1
            alive = set(fleet.alive())
            for i in set(range(len(fleet.servers))) - alive - reported:
                print(f"toktier fleet: replica {i} exited; nginx routes its sessions to the others",
                      file=sys.stderr, flush=True)
                reported.add(i)
            if not alive:
                print("toktier fleet: every replica exited", file=sys.stderr, flush=True)
                return 1
        print("toktier fleet: stopping", flush=True)
        return 0
    finally:
        fleet.stop()


def add_fleet_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``fleet`` to an ``argparse`` subparsers object; the parsed namespace's ``func`` runs it."""
    p = subparsers.add_parser(
        "fleet",
        help="N serve replicas behind nginx with session affinity (loopback)",
        description=(
            "Start N `toktier serve` replicas (tritonserver from nvidia-pytriton, free loopback ports) and nginx "
            f"in front of them (foreground child, generated config in a temp dir), routing by the {SESSION_HEADER} "
            "header with consistent hashing for gRPC and HTTP. Runs until SIGTERM or SIGINT. Needs nginx: "
            f"{NGINX_INSTALL}. See docs/fleet.md."
        ),
    )
    p.add_argument("--replicas", type=int, default=2, help="number of replicas (default 2)")
    p.add_argument("--tokenizer", default="default", help="tokenizer.json path, folder, Hub id or 'default'")
    p.add_argument("--host", default="127.0.0.1", help="address of nginx and the replicas (default loopback)")
    p.add_argument("--http-port", type=int, default=8000, help="nginx HTTP port (default 8000)")
    p.add_argument("--grpc-port", type=int, default=8001, help="nginx gRPC port (default 8001)")
    p.add_argument("--session-idle-seconds", type=float, default=None, help="replicas' session idle timeout")
    p.add_argument("--max-text-bytes", type=int, default=None, help="replicas' max_text_bytes")
    p.add_argument("--nginx", default=None, help="nginx binary (default: nginx on PATH, /usr/sbin/nginx)")
    p.add_argument("--nginx-workers", default="1", help="nginx worker_processes (default 1; 'auto' = one per core)")
    p.add_argument("--log-dir", default=None, help="folder for replica<i>.log (default: discard replica output)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for the replicas")
    p.add_argument("--print-nginx-config", action="store_true",
                   help="print the nginx config and exit: for --upstream HOST:HTTP_PORT:GRPC_PORT ... (repeatable), "
                        "else deploy/nginx/nginx.conf of docker-compose.yml")
    p.add_argument("--upstream", action="append", default=[], help="with --print-nginx-config: a replica HOST:HTTP:GRPC")
    p.set_defaults(func=run_fleet)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="toktier")
    add_fleet_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
