"""``toktier demo``: replay real agent sessions turn by turn, at agent scale, and prove every reply exact.

Agent sessions carry ~100K tokens (~400K chars) of old context and add ~1.5K chars a turn, while the bundled
SWE-agent trajectories end at 7K-17K chars. So every replayed session starts from a **base context** of
``context_chars`` chars (default :data:`DEFAULT_CONTEXT_CHARS`): the bundled trajectories rendered as ChatML
and concatenated (:func:`base_context`), cut back to the end of a message, as ``load/capacity.py`` builds
its contexts; turn ``i`` of a trajectory is ``base + turns[i]``. Every reply is compared with the HF
reference ``tokenizers.Tokenizer.from_file(path).encode(text).ids`` of the same text; the output ends with
the mismatch count, which must be 0.

:func:`run_served` (``toktier demo``, the main job) starts ``tritonserver`` with ``toktier_session`` and
``toktier_encode_fast`` and sends every turn through the client, one correlation ID per session and mode:

- ``toktier_session`` in full-text mode (``MODE=full``, ``REPLY=full``: the whole conversation so far, all
  ids back) with :class:`~toktier_backend.client.SessionClient` — the served repair;
- ``toktier_session`` in delta mode (``MODE=delta``, ``REPLY=patch``: only the new message, only the ids
  from ``KEEP`` on) — what a client that tracks its text can send;
- ``toktier_encode_fast`` on the same whole text — the served full re-encode: the fastest exact engine
  (fastokens) with no state, ``toktier_backend/data/models/`` (against a running server given by ``url``:
  ``toktier_encode``, which reuses indexed prefixes by content, so it is not a full re-encode there);
- the HF reference's own encode of the same text, in this process, timed; it is also the check, and runs
  after all served requests (between them it would slow them: ``docs/design/demo.md``).

Then one more session grows from 10K to over 1M chars (:data:`SWEEP_CHARS`): at each size :data:`SWEEP_TURNS` real turns
are appended and timed the same four ways, and a PNG of latency vs context size is written.

:func:`run_local` (``toktier demo --local``) replays through the library, no server.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_FAILURE = 2  # server failed to start or to answer, bad tokenizer or sessions folder
EXIT_INTERRUPTED = 130  # Ctrl-C
EXIT_TERMINATED = 143  # SIGTERM

#: the served modes, in table order: (key, label)
MODES = (
    ("full", "repair full-text", "toktier_session MODE=full REPLY=full: the whole conversation each turn"),
    ("delta", "repair delta+patch", "toktier_session MODE=delta REPLY=patch: the new message, ids from KEEP on"),
    ("encode", "full re-encode", "toktier_encode on the whole conversation"),
)


def _console(console=None):
    """``console``, or a rich Console that is 160 columns wide when not writing to a terminal (pipes, CI
    logs, tests), so the table is not squeezed into rich's default 80."""
    from rich.console import Console

    if console is not None:
        return console
    c = Console()
    if not c.is_terminal and "COLUMNS" not in os.environ:
        c = Console(width=160)
    return c


def _label(path: Path, width: int = 32) -> str:
    stem = path.stem
    return stem if len(stem) <= width else stem[: width // 2 - 1] + "…" + stem[-(width - width // 2):]


def run_local(tokenizer_spec: str | None, sessions_dir: str | None, *, console=None) -> int:
    """Replay sessions through the library (no server). Returns the number of mismatches."""
    from rich.progress import Progress
    from rich.table import Table

    from toktier_backend.tokenizer import load_tokenizer
    from toktier_backend.corpus import load_turns, trajectory_files

    console = _console(console)
    tok = load_tokenizer(tokenizer_spec)
    info = tok.describe()
    console.print(f"tokenizer [bold]{Path(info['path']).parent.name}[/] family={info['family']} "
                  f"engine={info['engine']} guarded code points={info['guarded_code_points']}")
    files = trajectory_files(sessions_dir)
    table = Table(title="session repair vs full re-encode (per turn, ms)")
    for col in ("session", "turns", "final chars", "repair p50", "full p50", "speedup", "routes", "mismatches"):
        table.add_column(col, justify="right" if col not in ("session", "routes") else "left")
    total_bad = 0
    all_rep, all_full = [], []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("replaying", total=sum(len(load_turns(f)) for f in files))
        for f in files:
            turns = load_turns(f)
            s = tok.session()
            rep, full, routes, bad = [], [], Counter(), 0
            for text in turns:
                t0 = time.perf_counter()
                ids = s.update(text)
                t1 = time.perf_counter()
                tok.encode(text)
                t2 = time.perf_counter()
                rep.append((t1 - t0) * 1e3)
                full.append((t2 - t1) * 1e3)
                routes[s.last_repair.route] += 1
                if not np.array_equal(ids, tok.reference.encode(text).ids):
                    bad += 1
                progress.advance(task)
            total_bad += bad
            all_rep += rep[1:]
            all_full += full[1:]
            p50r, p50f = float(np.median(rep[1:] or rep)), float(np.median(full[1:] or full))
            table.add_row(_label(f), str(len(turns)), f"{len(turns[-1]):,}", f"{p50r:.3f}", f"{p50f:.3f}",
                          f"{p50f / p50r:.1f}x", " ".join(f"{k}:{v}" for k, v in routes.items()), str(bad))
    console.print(table)
    if all_rep:
        console.print(f"all turns after the first: repair p50 {np.median(all_rep):.3f} ms, p90 "
                      f"{np.percentile(all_rep, 90):.3f} ms; full re-encode p50 {np.median(all_full):.3f} ms "
                      f"(n={len(all_rep)})")
    console.print(f"[bold]{'0 mismatches' if total_bad == 0 else f'{total_bad} MISMATCHES'}[/] against the HF reference")
    return total_bad


# ---------------------------------------------------------------- served: the main job

#: default base context of every replayed session, chars (~100K gpt2 tokens of agent text)
DEFAULT_CONTEXT_CHARS = 400_000
#: session sizes of the latency-vs-context sweep, chars (SWEEP_TURNS timed turns are appended at each)
SWEEP_CHARS = (10_000, 30_000, 100_000, 300_000, 1_000_000)
SWEEP_TURNS = 3
#: the served full re-encode: plain stateless model on the fastest exact engine (data/models/)
FAST_ENCODE_MODEL = "toktier_encode_fast"
FAST_MODEL_DIR = Path(__file__).resolve().parent / "data" / "models" / FAST_ENCODE_MODEL
END_OF_MESSAGE = "<|im_end|>\n"
#: model parameters of the server the demo starts: the shadow verifier off, since the demo compares every
#: reply with HF itself; left on, its HF re-encodes of the first replies would compete with the timed
#: requests for the cores (docs/design/demo.md)
DEMO_PARAMETERS = {"verifier_rate": "0", "verifier_first_n": "0"}

#: what each turn is timed on, in table order: (key, label, what)
MODES = (
    ("full", "repair full-text", "toktier_session MODE=full REPLY=full: the whole conversation each turn"),
    ("delta", "repair delta+patch", "toktier_session MODE=delta REPLY=patch: the new message, ids from KEEP on"),
    ("encode", "full re-encode", "toktier_encode_fast: fastokens on the whole conversation, no state"),
    ("hf", "HF encode", "HF tokenizers encode of the same text, in this process (the check, run after the served requests)"),
)
SERVED = ("full", "delta", "encode")


def default_plot_path() -> Path:
    """``<tmp>/toktier-demo/latency_vs_context.png``: outside any checkout, so never in git."""
    return Path(tempfile.gettempdir()) / "toktier-demo" / "latency_vs_context.png"


def base_context(n_chars: int, sessions: list[list[str]] | None = None) -> str:
    """About ``n_chars`` chars (at most) of old agent context: the final texts of ``sessions`` (lists of
    cumulative turns; default: the bundled trajectories) rendered as ChatML, concatenated and repeated,
    cut back to the end of the last whole message (``"<|im_end|>\\n"``). ``n_chars <= 0``: ``""``.

    Raises:
        ValueError: the sessions hold no text.
    """
    if n_chars <= 0:
        return ""
    if sessions is None:
        from toktier_backend.corpus import load_turns, trajectory_files

        sessions = [load_turns(f) for f in trajectory_files(None)]
    body = "".join(t[-1] for t in sessions if t)
    if not body:
        raise ValueError("no session text to build a base context from")
    text = (body * (n_chars // len(body) + 1))[:n_chars]
    end = text.rfind(END_OF_MESSAGE)
    return text[: end + len(END_OF_MESSAGE)] if end > 0 else text


class ServerFailure(Exception):
    """The server did not start, died, or failed a request."""


@dataclass
class _SessionResult:
    name: str
    turns: int
    chars: int
    tokens: int  # HF ids of the final text (set as the turns are replayed)
    ms: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k, *_ in MODES})  # turns after the first
    first_ms: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k, *_ in MODES})  # first turns
    routes: dict[str, Counter] = field(default_factory=lambda: {"full": Counter(), "delta": Counter()})
    bad: dict[str, int] = field(default_factory=lambda: {k: 0 for k in SERVED})


@dataclass
class _SweepPoint:
    chars: int  # session text after the point's last turn
    ms: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k, *_ in MODES})


def _encode_inputs(mod, text: str):
    x = mod.InferInput("TEXT", [1, 1], "BYTES")
    x.set_data_from_numpy(np.array([[text.encode("utf-8")]], dtype=np.object_))
    return [x]


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


class _Terminate(BaseException):
    """SIGTERM while the demo runs: unwinds like Ctrl-C, so the server is stopped."""


def run_served(
    tokenizer_spec: str | None = None,
    sessions_dir: str | None = None,
    *,
    protocol: str = "grpc",
    url: str | None = None,
    console=None,
    ready_timeout_s: float = 300.0,
    request_timeout_s: float = 120.0,
    repeat: int = 1,
    context_chars: int = DEFAULT_CONTEXT_CHARS,
    plot: str | Path | None = "default",
) -> int:
    """Start the server, replay every session on top of the base context through the client, check every
    reply against HF, grow one session from 10K to 1M+ chars for the plot, print the tables, stop the server.

    Args:
        tokenizer_spec: ``tokenizer.json``, a folder holding one, or a Hub id (``None``: the bundled GPT-2).
            The spec is resolved here and the server is given the same file.
        sessions_dir: folder of SWE-agent ``*.traj`` files (``None``: the bundled MIT sample).
        protocol: ``"grpc"`` or ``"http"``.
        url: ``host:port`` of a running server (``toktier serve``, same tokenizer; port of ``protocol``)
            instead of starting one; the full re-encode is then ``toktier_encode`` unless the server has
            ``toktier_encode_fast``.
        console: a rich Console (default: stdout).
        ready_timeout_s: how long to wait for the server to load the models.
        request_timeout_s: client timeout per request.
        repeat: replay every session this many times (fresh correlation IDs each pass) for more samples.
        context_chars: base context before every session's own turns, chars (0: none).
        plot: PNG path of the latency-vs-context sweep; ``"default"``: :func:`default_plot_path`; ``None``:
            no sweep, no plot.

    Returns:
        the process exit code: 0 (all replies equal the reference), 1 (mismatches), 2 (server failure, bad
        tokenizer or sessions folder), 130 (Ctrl-C), 143 (SIGTERM). The server this call started is always stopped.
    """
    console = _console(console)
    try:
        import tokenizers

        from toktier_backend.tokenizer import default_tokenizer_path
        from toktier_backend.corpus import load_turns, trajectory_files
        from toktier_backend.spec import resolve_path

        path = resolve_path(tokenizer_spec) if tokenizer_spec else default_tokenizer_path()
        reference = tokenizers.Tokenizer.from_file(str(path))
        files = trajectory_files(sessions_dir)
        sessions = [(f, load_turns(f)) for f in files]
    except Exception as e:  # UnsupportedTokenizer, FileNotFoundError, ValueError (not a trajectory), ...
        console.print(f"[bold red]toktier demo:[/] {e}")
        return EXIT_FAILURE
    sessions = [(f, turns) for f, turns in sessions if turns]
    if not sessions:
        console.print(f"[bold red]toktier demo:[/] the trajectories in {sessions_dir} hold no messages")
        return EXIT_FAILURE
    repeat = max(1, int(repeat))
    try:
        if protocol == "grpc":
            import tritonclient.grpc as mod
        else:
            import tritonclient.http as mod
        if url is None:
            from toktier_backend.deploy.server import find_triton_dist

            find_triton_dist()
    except (ImportError, FileNotFoundError) as e:
        console.print(f"[bold red]toktier demo:[/] the served demo needs the serve extra ({e}).\n"
                      "Install it with: pip install 'toktier_backend[serve]' — or run the library-only "
                      "replay with: toktier demo --local")
        return EXIT_FAILURE
    plot_path = default_plot_path() if plot == "default" else (Path(plot) if plot else None)

    base = base_context(context_chars)
    n_turns = sum(len(t) for _, t in sessions)
    console.print(f"tokenizer [bold]{path}[/]\nsessions: {len(sessions)} files, {n_turns} turns "
                  f"({sessions_dir or 'bundled SWE-agent sample, MIT'}), each on a base context of "
                  f"{len(base):,} chars")

    server = None
    workdir = tempfile.TemporaryDirectory(prefix="toktier-demo-")
    log_path = Path(workdir.name) / "tritonserver.log"
    previous_term = None
    try:
        previous_term = signal.signal(signal.SIGTERM, _raise_terminate)
    except ValueError:  # not the main thread: leave SIGTERM alone
        pass
    code = EXIT_FAILURE
    try:
        encode_model = FAST_ENCODE_MODEL
        if url is None:
            from toktier_backend.deploy.server import TritonServer

            server = TritonServer(str(path), model_repository=_demo_repository(Path(workdir.name) / "repo"),
                                  http_port=0, grpc_port=0, metrics_port=0, log_path=log_path, exit_timeout_s=5,
                                  parameters=DEMO_PARAMETERS)
            t0 = time.perf_counter()
            with console.status("starting tritonserver (loads the tokenizer in every model instance) …"):
                try:
                    server.start().wait_ready(ready_timeout_s)
                except (RuntimeError, OSError) as e:
                    raise ServerFailure(str(e)) from e
            url = server.grpc_url if protocol == "grpc" else server.http_url
            console.print(f"tritonserver pid {server.process.pid} ready in {time.perf_counter() - t0:.1f} s: "
                          f"{protocol} {url}")
        results, warm, sweep, encode_model = _replay(mod, url, protocol, sessions, base, reference, console,
                                                     request_timeout_s, server, repeat, encode_model,
                                                     plot_path is not None)
        code = _report(results, warm, sweep, console, len(base), plot_path, encode_model)
    except (KeyboardInterrupt, _Terminate) as e:
        console.print("[bold yellow]toktier demo: interrupted[/]")
        code = EXIT_TERMINATED if isinstance(e, _Terminate) else EXIT_INTERRUPTED
    except ServerFailure as e:
        console.print(f"[bold red]toktier demo: server failure:[/] {e}")
        code = EXIT_FAILURE
    except Exception:  # anything else is a failure too (exit 2, not Python's 1 = "mismatches")
        console.print_exception()
        code = EXIT_FAILURE
    finally:
        if server is not None:
            # a second Ctrl-C must not leave tritonserver running: ignore SIGINT/SIGTERM while it stops
            old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)} \
                if _main_thread() else {}
            try:
                rc = server.stop()
                console.print(f"tritonserver stopped (exit code {rc})")
            finally:
                for s, h in old.items():
                    signal.signal(s, h)
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)
        workdir.cleanup()
    return code


def _demo_repository(dst: Path) -> Path:
    """A model repository of ``toktier_session`` (from the shipped ``model_repository/``) and
    ``toktier_encode_fast`` (from ``data/models/``); ``TritonServer`` copies it and sets the tokenizer."""
    import shutil

    from toktier_backend.deploy.server import DEFAULT_MODEL_REPOSITORY

    dst.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(DEFAULT_MODEL_REPOSITORY / "toktier_session", dst / "toktier_session", ignore=ignore)
    shutil.copytree(FAST_MODEL_DIR, dst / FAST_ENCODE_MODEL, ignore=ignore)
    return dst


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_terminate(signum, frame):
    raise _Terminate()


def _log_tail(server) -> str:
    """Whether the server this demo started is still running, and the tail of its log."""
    if server is None:
        return ""
    if server.is_alive():
        return ""
    state = f"\ntritonserver exited (code {server.process.returncode})" if server.process else ""
    try:
        return state + server._log_tail(1500)
    except Exception:
        return state


@dataclass
class _Pending:
    """A text sent all ways and its replies, waiting for the HF check; ``record(hf_ms, exact, n_ids)``
    files the result where it belongs (a session's turn, a sweep point)."""

    text: str
    replies: dict[str, np.ndarray]
    record: Callable[[float, dict[str, bool], int], None]


class _Driver:
    """One full-text and one delta+patch session on the server plus the stateless encode model; each
    :meth:`turn` sends one text all ways (rotating which goes first) and times them. The replies wait in
    :attr:`pending` for :func:`_check`, which runs after all served requests: HF's encode of a 400K-1M-char
    text churns this process's heap and caches (tens of MB built and freed), which slows served calls
    made between such encodes (``docs/design/demo.md``)."""

    def __init__(self, mod, client, kwargs, url, protocol, key, timeout_s, server, encode_model, pending):
        from toktier_backend.client import SessionClient

        self.mod, self.client, self.kwargs, self.server = mod, client, kwargs, server
        self.encode_model, self.pending = encode_model, pending
        self.full = SessionClient(url, protocol=protocol, client=client, session_id=f"demo-{key}-full",
                                  reply="full", timeout_s=timeout_s)
        self.delta = SessionClient(url, protocol=protocol, client=client, session_id=f"demo-{key}-delta",
                                   reply="patch", timeout_s=timeout_s)
        self.text = ""
        self.k = 0

    def turn(self, text: str, where: str, record: Callable[[float, dict[str, bool], int], None]) -> dict[str, float]:
        """Send ``text`` (the whole session text after this turn) all ways. Returns ms per served mode;
        the replies go to :attr:`pending` with ``record``.

        Raises:
            ServerFailure: a request failed.
        """
        prev = self.text
        ms: dict[str, float] = {}
        replies: dict[str, np.ndarray] = {}

        def run_full():
            return self.full.update(text)

        def run_delta():
            if self.delta.is_open and text.startswith(prev):
                return self.delta.append(text[len(prev):])
            return self.delta.update(text)  # not an append: send the whole text

        def run_encode():
            res = self.client.infer(self.encode_model, _encode_inputs(self.mod, text), **self.kwargs)
            return res.as_numpy("INPUT_ID").reshape(-1)

        calls = {"full": run_full, "delta": run_delta, "encode": run_encode}
        order = list(SERVED[self.k % 3:] + SERVED[:self.k % 3])  # rotate, so no mode always goes first
        self.k += 1
        for m in order:
            t0 = time.perf_counter()
            try:
                replies[m] = calls[m]()  # a new array per reply (SessionClient never reuses one)
            except Exception as e:
                raise ServerFailure(f"{where} ({m}): {type(e).__name__}: {e}{_log_tail(self.server)}") from e
            ms[m] = (time.perf_counter() - t0) * 1e3
        self.text = text
        self.pending.append(_Pending(text, replies, record))
        return ms

    def close(self) -> None:
        for c in (self.full, self.delta):
            try:
                c.close()  # END frees the server's state
            except Exception:
                pass


def _check(pending: list[_Pending], reference, progress, task) -> None:
    """HF ``encode(text).ids`` of every pending text, timed, compared with each of its replies."""
    while pending:
        p = pending.pop(0)
        t0 = time.perf_counter()
        ref = np.asarray(reference.encode(p.text).ids, dtype=np.int32)
        hf_ms = (time.perf_counter() - t0) * 1e3
        p.record(hf_ms, {m: bool(np.array_equal(ids, ref)) for m, ids in p.replies.items()}, len(ref))
        progress.advance(task)


def _replay_session(driver: _Driver, f, turns, base, r: _SessionResult, progress=None, task=None) -> None:
    """One session through all modes, turn by turn; timings and routes go into ``r`` now, the HF time,
    mismatches and final id count when :func:`_check` runs."""

    def recorder(k: int):
        def record(hf_ms: float, exact: dict[str, bool], n_ids: int) -> None:
            (r.ms if k else r.first_ms)["hf"].append(hf_ms)
            for m, good in exact.items():
                r.bad[m] += 0 if good else 1
            if k == len(turns) - 1:
                r.tokens = n_ids
        return record

    try:
        for k, turn in enumerate(turns):
            ms = driver.turn(base + turn, f"session {f.name} turn {k}", recorder(k))
            for m, v in ms.items():
                (r.ms if k else r.first_ms)[m].append(v)
            r.routes["full"][driver.full.last.route] += 1
            r.routes["delta"][driver.delta.last.route] += 1
            if progress is not None:
                progress.advance(task)
    finally:
        driver.close()


def _sweep_turns(sessions) -> list[str]:
    """Real appended turns of 1K-2.5K chars (the agent median is ~1.5K), from the trajectories, cycled."""
    pool = [b[len(a):] for _, t in sessions for a, b in zip(t, t[1:]) if 1000 <= len(b) - len(a) <= 2500]
    if not pool:
        pool = [b[len(a):] for _, t in sessions for a, b in zip(t, t[1:]) if b != a] or ["<|im_start|>user\nok<|im_end|>\n"]
    return pool


def _sweep(driver: _Driver, sessions, progress, task) -> tuple[list[_SweepPoint], list[int]]:
    """Grow one session through :data:`SWEEP_CHARS`: at each size, one untimed growth request (old context
    appended; checked), then :data:`SWEEP_TURNS` timed real turns. Returns (one point per size, a one-element
    list that :func:`_check` fills with the sweep's mismatches)."""
    grow = base_context(SWEEP_CHARS[-1] + 200_000, [t for _, t in sessions])
    turns = _sweep_turns(sessions)
    points, pos, j = [], 0, 0
    bad = [0]

    def recorder(point: _SweepPoint | None):
        def record(hf_ms: float, exact: dict[str, bool], n_ids: int) -> None:
            bad[0] += sum(not v for v in exact.values())
            if point is not None:
                point.ms["hf"].append(hf_ms)
        return record

    try:
        for size in SWEEP_CHARS:
            need = max(0, size - len(driver.text))
            chunk = grow[pos: pos + need]
            end = chunk.rfind(END_OF_MESSAGE)
            chunk = chunk[: end + len(END_OF_MESSAGE)] if end > 0 else chunk
            pos += len(chunk)
            driver.turn(driver.text + chunk, f"sweep growth to {size:,} chars", recorder(None))
            point = _SweepPoint(0)
            for _ in range(SWEEP_TURNS):
                ms = driver.turn(driver.text + turns[j % len(turns)], f"sweep at {size:,} chars", recorder(point))
                j += 1
                for m, v in ms.items():
                    point.ms[m].append(v)
            point.chars = len(driver.text)
            points.append(point)
            progress.advance(task)
    finally:
        driver.close()
    return points, bad


def _replay(mod, url, protocol, sessions, base, reference, console, timeout_s, server, repeat, encode_model,
            sweep: bool):
    """Warm up, replay every session ``repeat`` times (one correlation ID per session, pass and mode), the
    sweep, then the HF check of every reply.

    Returns:
        (results of the timed passes, result of the warm-up: verified too, not timed in the table, sweep:
        (points, [mismatches]) or ``None``, the full re-encode's model).

    Raises:
        ServerFailure: a request failed.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    # client-side timeouts: gRPC per request (client_timeout, s); HTTP per connection (network_timeout, s).
    # Not SessionClient(timeout_s=) over HTTP: tritonclient.http's infer(timeout=) is Triton's server-side
    # request timeout in microseconds, and a float there fails every request.
    if protocol == "grpc":
        client, kwargs, session_timeout = mod.InferenceServerClient(url), {"client_timeout": timeout_s}, timeout_s
    else:
        client, kwargs, session_timeout = mod.InferenceServerClient(url, network_timeout=timeout_s), {}, None
    results, swept, pending = [], None, []

    def driver(key: str) -> _Driver:
        return _Driver(mod, client, kwargs, url, protocol, key, session_timeout, server, encode_model, pending)

    try:
        if encode_model == FAST_ENCODE_MODEL and not client.is_model_ready(FAST_ENCODE_MODEL):
            encode_model = "toktier_encode"  # a running `toktier serve`: our stateless model (prefix index)
            console.print(f"{FAST_ENCODE_MODEL} is not served at {url}: the full re-encode column is "
                          "toktier_encode (it reuses indexed prefixes)")
        n_turns = sum(len(t) for _, t in sessions)
        columns = (TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("steps"), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True, refresh_per_second=4) as progress:
            # warm-up, untimed but verified: the first requests of each model instance pay lazy setup
            f0, turns0 = sessions[0]
            turns0 = turns0[:3]
            warm = _SessionResult("warm-up", len(turns0), len(base) + len(turns0[-1]), 0)
            task = progress.add_task("warm-up", total=len(turns0))
            _replay_session(driver("warmup"), f0, turns0, base, warm, progress, task)
            progress.remove_task(task)
            task = progress.add_task("replaying", total=n_turns * repeat)
            for p in range(repeat):
                for i, (f, turns) in enumerate(sessions, 1):
                    progress.update(task, description=f"session {i}/{len(sessions)}"
                                    + (f" pass {p + 1}/{repeat}" if repeat > 1 else ""))
                    if p == 0:
                        results.append(_SessionResult(_label(f), len(turns), len(base) + len(turns[-1]), 0))
                    _replay_session(driver(f"{i}" + (f"-p{p + 1}" if repeat > 1 else "")), f, turns, base,
                                    results[i - 1], progress, task)
            progress.remove_task(task)
            if sweep:
                task = progress.add_task(f"growing a session to {SWEEP_CHARS[-1]:,}+ chars", total=len(SWEEP_CHARS))
                swept = _sweep(driver("sweep"), sessions, progress, task)
                progress.remove_task(task)
            task = progress.add_task("checking every reply against HF", total=len(pending))
            _check(pending, reference, progress, task)
    finally:
        try:
            client.close()
        except Exception:
            pass
    return results, warm, swept, encode_model


def _report(results, warm, sweep, console, base_chars: int, plot_path: Path | None, encode_model: str) -> int:
    """Print the tables and one line per mode, write the plot. Returns the exit code."""
    from rich.table import Table

    def routes(c: Counter) -> str:
        return " ".join(f"{k}:{v}" for k, v in sorted(c.items()))

    def p50(values: list[float]) -> float:
        return _pct(values, 50)

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.1f}x" if b > 0 else "–"

    labels = {k: label for k, label, _ in MODES}
    what = {k: w for k, _, w in MODES}
    if encode_model != FAST_ENCODE_MODEL:
        what["encode"] = f"{encode_model} on the whole conversation"
    table = Table(title=f"served session repair vs served full re-encode on a {base_chars:,}-char base context: "
                        "per-turn latency p50, ms (turns after the first)",
                  caption="; ".join(f"{labels[k]} = {what[k]}" for k, *_ in MODES))
    heads = ("session", "turns", "final chars", "final ids", "routes (full text)", "repair full-text",
             "repair delta+patch", "full re-encode", "HF encode", "re-encode ÷ full-text",
             "re-encode ÷ delta", "HF ÷ delta", "mismatches")
    for h in heads:
        left = h in ("session", "routes (full text)")
        table.add_column(h, justify="left" if left else "right", no_wrap=left)
    for r in results:
        rep, dp, enc, hf = (p50(r.ms[k]) for k in ("full", "delta", "encode", "hf"))
        bad = sum(r.bad.values())
        table.add_row(r.name, str(r.turns), f"{r.chars:,}", f"{r.tokens:,}", routes(r.routes["full"]),
                      f"{rep:.3f}", f"{dp:.3f}", f"{enc:.3f}", f"{hf:.1f}", ratio(enc, rep), ratio(enc, dp),
                      ratio(hf, dp), str(bad) if bad == 0 else f"[bold red]{bad}[/]")
    console.print(table)
    for key, label, _ in MODES:
        later = [x for r in results for x in r.ms[key]]
        first = [x for r in results for x in r.first_ms[key]]
        line = (f"{label + ':':<19} p50 {_pct(later, 50):8.3f} ms  p90 {_pct(later, 90):8.3f} ms  n={len(later)}"
                f"  (first turns p50 {_pct(first, 50):.3f} ms, n={len(first)})")
        if key in ("full", "delta"):
            line += f"  routes {routes(sum((r.routes[key] for r in results), Counter()))}"
        if key in SERVED:
            line += f"  mismatches {sum(r.bad[key] for r in results)}"
        console.print(line, highlight=False)
    later = {k: [x for r in results for x in r.ms[k]] for k, *_ in MODES}
    enc = p50(later["encode"])

    def paired(a: str, b: str) -> str:  # median over turns of a/b, each pair timed back to back
        v = [x / y for x, y in zip(later[a], later[b]) if y > 0]
        return f"{np.median(v):.1f}x" if v else "–"

    console.print(f"served full re-encode ÷ served repair (ratio of the p50s; median of the per-turn ratios): "
                  f"full-text {ratio(enc, p50(later['full']))}; {paired('encode', 'full')}, delta+patch "
                  f"{ratio(enc, p50(later['delta']))}; {paired('encode', 'delta')}; HF encode ÷ delta+patch "
                  f"{ratio(p50(later['hf']), p50(later['delta']))}", highlight=False)

    sweep_bad = 0
    if sweep is not None:
        points, (sweep_bad,) = sweep
        t = Table(title=f"one session grown from {SWEEP_CHARS[0]:,} to {points[-1].chars:,} chars: per-turn "
                        f"latency, median of {SWEEP_TURNS} real turns, ms")
        for h in ("context chars", "repair delta+patch", "repair full-text", "full re-encode", "HF encode",
                  "re-encode ÷ delta"):
            t.add_column(h, justify="right")
        for pt in points:
            d, f, e, h = (p50(pt.ms[k]) for k in ("delta", "full", "encode", "hf"))
            t.add_row(f"{pt.chars:,}", f"{d:.3f}", f"{f:.3f}", f"{e:.3f}", f"{h:.1f}", ratio(e, d))
        console.print(t)
        if plot_path is not None:
            try:
                _plot(points, plot_path, encode_model)
                console.print(f"plot: {plot_path}", highlight=False)
            except ImportError as e:
                console.print(f"no plot ({e}); pip install matplotlib")
    replies = sum(len(r.ms[k]) + len(r.first_ms[k]) for r in [*results, warm] for k in SERVED)
    if sweep is not None:
        replies += len(sweep[0]) * (SWEEP_TURNS + 1) * len(SERVED)
    total_bad = sum(sum(r.bad.values()) for r in [*results, warm]) + sweep_bad
    n_warm = sum(len(warm.ms[k]) + len(warm.first_ms[k]) for k in SERVED)
    what = f"{replies} served replies checked, {n_warm} of them warm-up"
    if total_bad == 0:
        console.print(f"[bold green]0 mismatches[/] against the HF reference ({what})")
        return EXIT_OK
    console.print(f"[bold red]{total_bad} MISMATCHES[/] against the HF reference ({what})")
    return EXIT_MISMATCH


def _plot(points: list[_SweepPoint], path: Path, encode_model: str) -> None:
    """Latency (ms, log) vs session context (chars, log) per mode, to ``path`` (PNG).

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    xs = [p.chars for p in points]
    style = {"delta": ("tab:green", "o-"), "full": ("tab:olive", "s-"), "encode": ("tab:blue", "^-"),
             "hf": ("tab:red", "v--")}
    labels = {"delta": "served repair, delta+patch (toktier_session)",
              "full": "served repair, full text (toktier_session)",
              "encode": f"served full re-encode ({encode_model})", "hf": "HF tokenizers encode (in process)"}
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for key in ("delta", "full", "encode", "hf"):
        color, fmt = style[key]
        ax.plot(xs, [float(np.median(p.ms[key])) for p in points], fmt, color=color, label=labels[key])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("session context (chars)")
    ax.set_ylabel(f"latency per turn (ms, median of {SWEEP_TURNS})")
    ax.set_title("one agent session grown turn by turn: latency per turn vs context")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
