"""``toktier serve``: run our model repository on the ``tritonserver`` binary shipped in ``nvidia-pytriton``.

The ``nvidia-pytriton`` wheel carries a full ``tritonserver`` (2.51 in PyTriton 0.7.0), the Python backend
(``backends/python/libtriton_python.so``) and one Python backend stub per Python version
(``python_backend_stubs/3.X/triton_python_backend_stub``). :class:`TritonServer` does what PyTriton does
for itself:

1. copies ``model_repository/`` to a temp dir and substitutes the model parameters (``tokenizer``,
   ``max_text_bytes``) and the sequence batcher's ``max_sequence_idle_microseconds``;
2. builds a backend directory whose ``python/`` holds the stub for this interpreter;
3. starts ``tritonserver`` with ``LD_LIBRARY_PATH`` = this Python's ``LIBDIR`` (the stub links
   ``libpython3.X.so``) + ``nvidia_pytriton.libs``, and ``PYTHONPATH`` starting with the folder that holds
   ``toktier_backend`` (so the stub imports this very package);
4. waits for ``/v2/health/ready``; stops with SIGINT, then SIGKILL after ``exit_timeout_s``.

:class:`PyTritonServer` serves the same handler through PyTriton instead (``--pytriton``; see
:mod:`toktier_backend.faces.pytriton`). Both bind to loopback unless told otherwise.
"""

from __future__ import annotations

import os
import re
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
from typing import Sequence

from toktier_backend.config import DEFAULT_SPECS, PACKAGE_ROOT, stop_on_signals, stub_environment  # noqa: F401  (re-exported)


def _default_model_repository() -> Path:
    """The repository shipped as package data (``toktier_backend/model_repository``: in a source checkout a
    symlink to the top-level ``model_repository/``, in an installed wheel a copy), else the checkout's."""
    shipped = Path(__file__).resolve().parents[1] / "model_repository"
    return shipped.resolve() if shipped.is_dir() else PACKAGE_ROOT / "model_repository"


DEFAULT_MODEL_REPOSITORY = _default_model_repository()
"""``model_repository/``: the package-data copy in an installed wheel, the top-level folder in a checkout."""


# ---------------------------------------------------------------- the tritonserver shipped in nvidia-pytriton


@dataclass(frozen=True)
class TritonDist:
    """Paths of the Triton Inference Server shipped inside the ``nvidia-pytriton`` wheel."""

    tritonserver: Path  # bin/tritonserver
    backends: Path  # backends/ (python/libtriton_python.so, without a stub)
    python_stub: Path  # python_backend_stubs/<X.Y>/triton_python_backend_stub for this interpreter
    libs: Path  # nvidia_pytriton.libs (bundled shared libraries)


def find_triton_dist() -> TritonDist:
    """Locate ``tritonserver`` and the Python backend stub inside the installed ``nvidia-pytriton``.

    Raises:
        FileNotFoundError: ``nvidia-pytriton`` is not installed, or ships no stub for this Python.
    """
    try:
        import importlib.util

        spec = importlib.util.find_spec("pytriton")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "nvidia-pytriton is not installed, so there is no tritonserver binary to run. "
            "Install it with: pip install 'toktier_backend[serve]' (or pass --tritonserver PATH)."
        )
    root = Path(list(spec.submodule_search_locations)[0])
    dist = root / "tritonserver"
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    found = TritonDist(
        tritonserver=dist / "bin" / "tritonserver",
        backends=dist / "backends",
        python_stub=dist / "python_backend_stubs" / version / "triton_python_backend_stub",
        libs=root.parent / "nvidia_pytriton.libs",
    )
    for path in (found.tritonserver, found.backends / "python", found.python_stub):
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing from nvidia-pytriton at {root} (Python {version}).")
    return found


# ---------------------------------------------------------------- model repository


def _set_parameter(config: str, key: str, value: str) -> str:
    pattern = re.compile(r'(\{\s*key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*)"[^"]*"')
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    new, n = pattern.subn(lambda m: m.group(1) + '"' + escaped + '"', config)
    if n == 0:
        raise ValueError(f"config.pbtxt has no parameter {key!r} to substitute")
    return new


def gpu_instance_group(gpu_instances: int, cpu_instances: int = 1) -> str:
    """``toktier_encode``'s instance group for a GPU machine: ``gpu_instances`` GPU instances on each visible
    GPU (Triton's ``count`` without ``gpus``) and ``cpu_instances`` CPU instances that take the overflow."""
    groups = [f"{{ kind: KIND_GPU count: {int(gpu_instances)} }}"]
    if cpu_instances > 0:
        groups.append(f"{{ kind: KIND_CPU count: {int(cpu_instances)} }}")
    return "instance_group [ " + ", ".join(groups) + " ]"


_INSTANCE_GROUP = re.compile(r"^instance_group[ \t]*\[.*\][ \t]*$", re.MULTILINE)


def prepare_repository(
    destination: str | Path,
    *,
    tokenizer: str,
    source: str | Path | None = None,
    max_text_bytes: int | None = None,
    session_idle_s: float | None = None,
    parameters: dict[str, str] | None = None,
    encode_gpu_instances: int = 0,
) -> Path:
    """Copy a model repository and substitute the serve-time settings in each ``config.pbtxt``.

    Args:
        destination: folder to create (must not exist).
        tokenizer: tokenizer spec for the ``tokenizer`` parameter (paths are made absolute).
        source: repository to copy (default :data:`DEFAULT_MODEL_REPOSITORY`).
        max_text_bytes: value for the ``max_text_bytes`` parameter, in UTF-8 bytes (``None`` keeps it).
        session_idle_s: ``max_sequence_idle_microseconds`` in seconds, for models with a sequence batcher
            (``None`` keeps it); the session store's TTL follows it.
        parameters: more model parameters to substitute (``session_budget_bytes``, ``tokenizer_sha256``,
            ``verifier_rate``, ``quarantine_file``, ``gpu_engine``, ``gpu_crossover_chars``, ...), in every
            config that declares them.
        encode_gpu_instances: when > 0, ``toktier_encode``'s ``instance_group`` becomes
            :func:`gpu_instance_group` (that many GPU instances per GPU plus one CPU instance); 0 keeps the
            shipped CPU-only group (Triton refuses ``KIND_GPU`` on a machine without GPUs).

    Returns:
        the new repository path.

    Raises:
        FileNotFoundError: no such source repository.
        ValueError: a parameter or the ``instance_group`` line to substitute is missing.
    """
    src = Path(source) if source is not None else DEFAULT_MODEL_REPOSITORY
    if not src.is_dir():
        raise FileNotFoundError(f"model repository {src} not found; pass --model-repository DIR")
    dst = Path(destination)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    spec = tokenizer
    if spec not in DEFAULT_SPECS and Path(spec).exists():
        spec = str(Path(spec).resolve())
    for config_path in sorted(dst.glob("*/config.pbtxt")):
        text = config_path.read_text()
        if config_path.parent.name == "preprocessing":  # TensorRT-LLM's template keys left unfilled
            from toktier_backend.faces.trtllm_config import fill_defaults

            text = fill_defaults(text)
        if '"tokenizer"' in text:
            text = _set_parameter(text, "tokenizer", spec)
        if max_text_bytes is not None and '"max_text_bytes"' in text:
            text = _set_parameter(text, "max_text_bytes", str(int(max_text_bytes)))
        for key, value in (parameters or {}).items():
            if f'"{key}"' in text:
                text = _set_parameter(text, key, str(value))
        if session_idle_s is not None and "max_sequence_idle_microseconds" in text:
            us = max(1, int(round(session_idle_s * 1e6)))
            text = re.sub(r"max_sequence_idle_microseconds:\s*\d+", f"max_sequence_idle_microseconds: {us}", text)
        if encode_gpu_instances > 0 and config_path.parent.name == "toktier_encode":
            text, n = _INSTANCE_GROUP.subn(gpu_instance_group(encode_gpu_instances), text)
            if n != 1:
                raise ValueError(f"{config_path}: expected one instance_group line to substitute, found {n}")
        config_path.write_text(text)
    return dst


# ---------------------------------------------------------------- ports and readiness


def free_ports(n: int = 3, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free on ``host`` right now (the OS picks them)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _http_ready(host: str, port: int, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/v2/health/ready", timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _with_parent_death_signal(cmd: list[str]) -> list[str]:
    """Prefix ``cmd`` with util-linux ``setpriv --pdeathsig TERM`` when available, so tritonserver stops if
    this process dies without stopping it (no ``preexec_fn``: unsafe with threads and gRPC loaded)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", *cmd] if setpriv and sys.platform.startswith("linux") else cmd


# ---------------------------------------------------------------- servers


class TritonServer:
    """Our model repository on the ``tritonserver`` binary of ``nvidia-pytriton`` (or another one).

    Args:
        tokenizer: tokenizer spec (``tokenizer.json`` path, folder, Hub id, or ``"default"``).
        model_repository: repository to copy (default :data:`DEFAULT_MODEL_REPOSITORY`).
        host: address for the HTTP, gRPC and metrics endpoints (loopback by default).
        http_port, grpc_port, metrics_port: ports; ``0`` picks free ones.
        max_text_bytes: override of the models' ``max_text_bytes`` (UTF-8 bytes).
        session_idle_s: override of the sequence batcher's idle timeout = session TTL (seconds).
        log_path: file for tritonserver's output (``None``: inherit stdout/stderr).
        tritonserver: a ``tritonserver`` binary with its own Python backend (e.g. NGC's
            ``/opt/tritonserver/bin/tritonserver``); default: the one in ``nvidia-pytriton``.
        exit_timeout_s: seconds to wait for in-flight requests on stop before SIGKILL.
        toktier_metrics_port: port of the ``toktier_*`` metrics exporter run in this process (aggregating
            every instance through ``PROMETHEUS_MULTIPROC_DIR``); ``0`` picks a free one, ``None`` (the
            default here; ``toktier serve`` uses 8003) runs none.
        parameters: model parameters to substitute (``session_budget_bytes``, ``tokenizer_sha256``,
            ``verifier_rate``, ``verifier_first_n``, ``verifier_debug``, ``quarantine_file``, ``engine``).
        env: extra environment variables for tritonserver and its stubs.
        encode_gpu_instances: GPU instances of ``toktier_encode`` per GPU, beside one CPU instance (0: the
            shipped CPU-only group); see :func:`prepare_repository`.
        extra_model_repositories: more repositories served beside it (each copied and substituted the same
            way, passed as another ``--model-repository``), e.g. the TensorRT-LLM ensemble example.
    """

    def __init__(
        self,
        tokenizer: str = "default",
        *,
        model_repository: str | Path | None = None,
        host: str = "127.0.0.1",
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        max_text_bytes: int | None = None,
        session_idle_s: float | None = None,
        log_path: str | Path | None = None,
        tritonserver: str | Path | None = None,
        exit_timeout_s: float = 10.0,
        extra_model_repositories: Sequence[str | Path] = (),
        toktier_metrics_port: int | None = None,
        parameters: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        encode_gpu_instances: int = 0,
    ):
        ports = free_ports(4, host)
        self.encode_gpu_instances = int(encode_gpu_instances)
        self.toktier_metrics_port = None if toktier_metrics_port is None else (toktier_metrics_port or ports[3])
        self.parameters = dict(parameters or {})
        self.env = dict(env or {})
        self._exporter = None
        self.host = host
        self.http_port = http_port or ports[0]
        self.grpc_port = grpc_port or ports[1]
        self.metrics_port = metrics_port or ports[2]
        self.tokenizer = tokenizer
        self.model_repository = model_repository
        self.max_text_bytes = max_text_bytes
        self.session_idle_s = session_idle_s
        self.log_path = Path(log_path) if log_path else None
        self.tritonserver = Path(tritonserver) if tritonserver else None
        self.exit_timeout_s = exit_timeout_s
        self.extra_model_repositories = [Path(p) for p in extra_model_repositories]
        self._extra_prepared: list[Path] = []
        self.workdir: Path | None = None
        self.process: subprocess.Popen | None = None
        self._log = None

    # urls ------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def toktier_metrics_url(self) -> str | None:
        """``toktier_*`` metrics of all instances (``None`` when no exporter runs)."""
        if self.toktier_metrics_port is None:
            return None
        return f"http://{self.host}:{self.toktier_metrics_port}/metrics"

    # lifecycle -------------------------------------------------------
    def command(self, repository: Path, backends: Path | None) -> list[str]:
        binary = self.tritonserver or find_triton_dist().tritonserver
        cmd = [
            str(binary),
            f"--model-repository={repository}",
            *(f"--model-repository={p}" for p in self._extra_prepared),
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            "--allow-gpu-metrics=false",
            f"--exit-timeout-secs={max(1, int(self.exit_timeout_s))}",
            # unique shared-memory names, so several servers can run side by side
            f"--backend-config=python,shm-region-prefix-name=toktier{os.getpid()}_{self.grpc_port}_",
            "--backend-config=python,shm-default-byte-size=16777216",
        ]
        if backends is not None:
            cmd.append(f"--backend-directory={backends}")
        return cmd

    def start(self) -> "TritonServer":
        """Prepare the repository and backend directory, and start ``tritonserver`` (does not wait)."""
        if self.process is not None:
            raise RuntimeError("server already started")
        self.workdir = Path(tempfile.mkdtemp(prefix="toktier-serve-"))
        repository = prepare_repository(
            self.workdir / "models",
            tokenizer=self.tokenizer,
            source=self.model_repository,
            max_text_bytes=self.max_text_bytes,
            session_idle_s=self.session_idle_s,
            parameters=self.parameters,
            encode_gpu_instances=self.encode_gpu_instances,
        )
        self._extra_prepared = [
            prepare_repository(self.workdir / f"models_extra{i}", tokenizer=self.tokenizer, source=src,
                               max_text_bytes=self.max_text_bytes, session_idle_s=self.session_idle_s)
            for i, src in enumerate(self.extra_model_repositories)
        ]
        libs: list[Path] = []
        backends: Path | None = None
        if self.tritonserver is None:
            dist = find_triton_dist()
            backends = self.workdir / "backends"
            shutil.copytree(dist.backends, backends, ignore=shutil.ignore_patterns("__pycache__"))
            shutil.copy2(dist.python_stub, backends / "python" / "triton_python_backend_stub")
            libs.append(dist.libs)
        env = stub_environment(libs)
        env.update(self.env)
        # toktier_* metrics: every instance (a process) writes to this folder; one exporter aggregates it
        metrics_dir = self.workdir / "metrics"
        metrics_dir.mkdir()
        env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        if self.toktier_metrics_port is not None:
            self._start_exporter(metrics_dir)
        if self.log_path is not None:
            self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            _with_parent_death_signal(self.command(repository, backends)),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT if self._log else None,
            start_new_session=True,  # our signal handler decides when it stops
        )
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> "TritonServer":
        """Block until ``/v2/health/ready`` answers 200 (all models loaded).

        Raises:
            RuntimeError: tritonserver exited, or was not ready within ``timeout_s`` seconds (it is stopped).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                self.stop()
                raise RuntimeError(f"tritonserver exited with code {code} before it was ready{self._log_tail()}")
            if _http_ready(self.host, self.http_port):
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"tritonserver was not ready after {timeout_s:g} s{self._log_tail()}")

    def stop(self) -> int | None:
        """Stop tritonserver (SIGINT, then SIGKILL after ``exit_timeout_s`` + 5 s) and remove the temp dir.

        Returns:
            tritonserver's exit code, or ``None`` if it was not running.
        """
        code = None
        if self._exporter is not None:
            self._exporter.shutdown()
            self._exporter.server_close()
            self._exporter = None
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGINT)
                try:
                    self.process.wait(timeout=self.exit_timeout_s + 5)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            code = self.process.returncode
            self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        return code

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _start_exporter(self, metrics_dir: Path) -> None:
        try:
            from toktier_backend.serving.metrics import start_exporter
        except ImportError:  # pragma: no cover - prometheus_client is in the serve extra
            return
        try:
            self._exporter, _ = start_exporter(self.toktier_metrics_port, self.host, multiproc_dir=metrics_dir)
        except ImportError:
            print("toktier serve: prometheus_client is not installed: no toktier_* metrics "
                  "(pip install 'toktier_backend[serve]')", file=sys.stderr, flush=True)

    def _log_tail(self, n: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n--- tritonserver log tail ---\n" + self.log_path.read_bytes()[-n:].decode("utf-8", "replace")

    def __enter__(self) -> "TritonServer":
        return self.start().wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()


class PyTritonServer:
    """The same handler served through PyTriton (``--pytriton``); same interface as :class:`TritonServer`.

    PyTriton 0.7 neither exposes the correlation ID nor configures a sequence batcher, so this face keys
    sessions by the request parameters ``session_id`` (int or str), ``session_start`` and ``session_end``
    (bool); see :mod:`toktier_backend.faces.pytriton`.
    """

    def __init__(
        self,
        tokenizer: str = "default",
        *,
        host: str = "127.0.0.1",
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        max_text_bytes: int | None = None,
        session_idle_s: float | None = None,
        log_path: str | Path | None = None,
        toktier_metrics_port: int | None = None,
        parameters: dict[str, str] | None = None,
    ):
        ports = free_ports(4, host)
        self.host = host
        self.http_port = http_port or ports[0]
        self.grpc_port = grpc_port or ports[1]
        self.metrics_port = metrics_port or ports[2]
        self.toktier_metrics_port = None if toktier_metrics_port is None else (toktier_metrics_port or ports[3])
        self.parameters = dict(parameters or {})
        self.tokenizer = tokenizer
        self.max_text_bytes = max_text_bytes
        self.session_idle_s = session_idle_s
        self.log_path = Path(log_path) if log_path else None
        self.triton = None
        self.handler = None
        self._exporter = None

    http_url = TritonServer.http_url
    grpc_url = TritonServer.grpc_url
    metrics_url = TritonServer.metrics_url
    toktier_metrics_url = TritonServer.toktier_metrics_url

    def start(self) -> "PyTritonServer":
        from toktier_backend.faces import pytriton as pytriton_app

        self.triton, self.handler = pytriton_app.create(
            self.tokenizer,
            host=self.host,
            http_port=self.http_port,
            grpc_port=self.grpc_port,
            metrics_port=self.metrics_port,
            max_text_bytes=self.max_text_bytes,
            session_idle_s=self.session_idle_s,
            log_path=self.log_path,
            parameters=self.parameters,
        )
        if self.toktier_metrics_port is not None:  # in-process handler: the default registry
            from toktier_backend.serving.metrics import start_exporter

            self._exporter, _ = start_exporter(self.toktier_metrics_port, self.host)
        self.triton.run()  # returns once the models are ready
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> "PyTritonServer":
        deadline = time.monotonic() + timeout_s
        while not _http_ready(self.host, self.http_port):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"PyTriton was not ready after {timeout_s:g} s")
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        if self._exporter is not None:
            self._exporter.shutdown()
            self._exporter.server_close()
            self._exporter = None
        if self.triton is not None:
            self.triton.stop()
            self.triton = None
        if self.handler is not None:
            self.handler.close()

    def is_alive(self) -> bool:
        return self.triton is not None and self.triton.is_alive()

    def __enter__(self) -> "PyTritonServer":
        return self.start().wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------- the serve command


def serve(
    tokenizer: str,
    *,
    model_repository: str | Path | None = None,
    host: str = "127.0.0.1",
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    max_text_bytes: int | None = None,
    session_idle_s: float | None = None,
    pytriton: bool = False,
    tritonserver: str | Path | None = None,
    ready_timeout_s: float = 300.0,
    with_ensemble: bool = False,
    toktier_metrics_port: int | None = 8003,
    parameters: dict[str, str] | None = None,
    encode_gpu_instances: int = 0,
) -> int:
    """Serve until SIGTERM or SIGINT, then stop cleanly. Returns the process exit code (0 on a clean stop).

    ``with_ensemble`` also serves the TensorRT-LLM ensemble example (``ensemble`` -> our ``preprocessing``
    -> a CPU stand-in ``tensorrt_llm``; see ``docs/integrations.md``); not with ``pytriton``.
    ``encode_gpu_instances`` > 0 serves ``toktier_encode`` with that many GPU instances per GPU plus one CPU
    instance (:func:`prepare_repository`); not with ``pytriton``.
    """
    if with_ensemble and pytriton:
        raise ValueError("--with-ensemble needs tritonserver's model repository; PyTriton (--pytriton) cannot serve it")
    if encode_gpu_instances and pytriton:
        raise ValueError("--encode-gpu-instances sets tritonserver instance groups; PyTriton (--pytriton) has none")
    if pytriton:
        server: TritonServer | PyTritonServer = PyTritonServer(
            tokenizer,
            host=host,
            http_port=http_port,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
            max_text_bytes=max_text_bytes,
            session_idle_s=session_idle_s,
            toktier_metrics_port=toktier_metrics_port,
            parameters=parameters,
        )
    else:
        server = TritonServer(
            tokenizer,
            model_repository=model_repository,
            host=host,
            http_port=http_port,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
            max_text_bytes=max_text_bytes,
            session_idle_s=session_idle_s,
            tritonserver=tritonserver,
            extra_model_repositories=_ensemble_example() if with_ensemble else (),
            toktier_metrics_port=toktier_metrics_port,
            parameters=parameters,
            encode_gpu_instances=encode_gpu_instances,
        )
    with stop_on_signals() as stop:
        return _run_until(server, stop, tokenizer, pytriton, ready_timeout_s)


def _run_until(server, stop: threading.Event, tokenizer, pytriton: bool, ready_timeout_s: float) -> int:
    try:
        server.start()
        server.wait_ready(ready_timeout_s)
        face = "PyTriton" if pytriton else f"tritonserver pid {server.process.pid}"
        print(
            f"toktier serve ({face}, tokenizer {tokenizer}): ready — "
            f"HTTP {server.http_url}  gRPC {server.grpc_url}  metrics {server.metrics_url}"
            + (f"  toktier metrics {server.toktier_metrics_url}" if getattr(server, "toktier_metrics_url", None) else ""),
            flush=True,
        )
        while not stop.wait(0.5):
            if not server.is_alive():
                print("toktier serve: the server exited", file=sys.stderr, flush=True)
                return 1
        print("toktier serve: stopping", flush=True)
        return 0
    finally:
        server.stop()


def _ensemble_example() -> list[Path]:
    from toktier_backend.faces.trtllm import ENSEMBLE_EXAMPLE_REPOSITORY

    return [ENSEMBLE_EXAMPLE_REPOSITORY]
