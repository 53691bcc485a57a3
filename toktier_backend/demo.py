"""``toktier demo``: replay real agent sessions turn by turn and prove every reply exact.

Each trajectory becomes a session: turn ``i`` sends the whole conversation so far (full-text mode, as
coding agents do). For every turn we time the session repair and a full re-encode of the same text, and
compare the ids with the HF reference ``tokenizers.Tokenizer.from_file(path).encode(text).ids``. The
output ends with the mismatch count, which must be 0.

:func:`run_served` (``toktier demo``, the main job) starts ``tritonserver`` with our model repository and
sends every turn through the client, one correlation ID per session and mode:

- ``toktier_session`` in full-text mode (``MODE=full``, ``REPLY=full``: the whole conversation so far, all
  ids back) with :class:`~toktier_backend.client.SessionClient` — the served repair;
- ``toktier_session`` in delta mode (``MODE=delta``, ``REPLY=patch``: only the new message, only the ids
  from ``KEEP`` on) — what a client that tracks its text can send;
- ``toktier_encode`` on the same whole text — the served full re-encode.

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


class ServerFailure(Exception):
    """The server did not start, died, or failed a request."""


@dataclass
class _SessionResult:
    name: str
    turns: int
    chars: int
    tokens: int
    ms: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k, *_ in MODES})  # turns after the first
    first_ms: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k, *_ in MODES})  # first turns
    routes: dict[str, Counter] = field(default_factory=lambda: {"full": Counter(), "delta": Counter()})
    bad: dict[str, int] = field(default_factory=lambda: {k: 0 for k, *_ in MODES})


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
) -> int:
    """Start the server, replay every session through the client, check every reply against HF, print the
    table, stop the server.

    Args:
        tokenizer_spec: ``tokenizer.json``, a folder holding one, or a Hub id (``None``: the bundled GPT-2).
            The spec is resolved here and the server is given the same file.
        sessions_dir: folder of SWE-agent ``*.traj`` files (``None``: the bundled MIT sample).
        protocol: ``"grpc"`` or ``"http"``.
        url: ``host:port`` of a running server (``toktier serve``, same tokenizer; port of ``protocol``)
            instead of starting one.
        console: a rich Console (default: stdout).
        ready_timeout_s: how long to wait for the server to load the models.
        request_timeout_s: client timeout per request.
        repeat: replay every session this many times (fresh correlation IDs each pass) for more samples.

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

    n_turns = sum(len(t) for _, t in sessions)
    console.print(f"tokenizer [bold]{path}[/]\nsessions: {len(sessions)} files, {n_turns} turns "
                  f"({sessions_dir or 'bundled SWE-agent sample, MIT'})")

    server = None
    workdir = tempfile.TemporaryDirectory(prefix="toktier-demo-")
    log_path = Path(workdir.name) / "tritonserver.log"
    previous_term = None
    try:
        previous_term = signal.signal(signal.SIGTERM, _raise_terminate)
    except ValueError:  # not the main thread: leave SIGTERM alone
        pass
    code = EXIT_FAILURE
    results: list[_SessionResult] = []
    try:
        if url is None:
            from toktier_backend.deploy.server import TritonServer

            server = TritonServer(str(path), http_port=0, grpc_port=0, metrics_port=0, log_path=log_path,
                                  exit_timeout_s=5)
            t0 = time.perf_counter()
            with console.status("starting tritonserver (loads the tokenizer in every model instance) …"):
                try:
                    server.start().wait_ready(ready_timeout_s)
                except (RuntimeError, OSError) as e:
                    raise ServerFailure(str(e)) from e
            url = server.grpc_url if protocol == "grpc" else server.http_url
            console.print(f"tritonserver pid {server.process.pid} ready in {time.perf_counter() - t0:.1f} s: "
                          f"{protocol} {url}")
        results, warm = _replay(mod, url, protocol, sessions, reference, console, request_timeout_s, server, repeat)
        code = _report(results, warm, console)
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


def _replay_session(mod, client, kwargs, url, protocol, session_key, f, turns, refs, timeout_s, server,
                    r: "_SessionResult", progress=None, task=None) -> None:
    """One session through all modes, turn by turn; timings, routes and mismatches go into ``r``."""
    from toktier_backend.client import SessionClient

    full = SessionClient(url, protocol=protocol, client=client, session_id=f"demo-{session_key}-full",
                         reply="full", timeout_s=timeout_s)
    delta = SessionClient(url, protocol=protocol, client=client, session_id=f"demo-{session_key}-delta",
                          reply="patch", timeout_s=timeout_s)
    try:
        for k, (text, ref) in enumerate(zip(turns, refs)):
            prev = turns[k - 1] if k else ""

            def run_full():
                return full.update(text)

            def run_delta():
                if text.startswith(prev):
                    return delta.append(text[len(prev):])
                return delta.update(text)  # not an append: send the whole text

            def run_encode():
                res = client.infer("toktier_encode", _encode_inputs(mod, text), **kwargs)
                return res.as_numpy("INPUT_ID").reshape(-1)

            calls = {"full": run_full, "delta": run_delta, "encode": run_encode}
            order = [m for m, *_ in MODES]
            order = order[k % 3:] + order[:k % 3]  # rotate, so no mode always goes first
            for m in order:
                t0 = time.perf_counter()
                try:
                    ids = calls[m]()
                except Exception as e:
                    raise ServerFailure(
                        f"session {f.name} turn {k} ({m}): {type(e).__name__}: {e}{_log_tail(server)}"
                    ) from e
                (r.ms if k else r.first_ms)[m].append((time.perf_counter() - t0) * 1e3)
                if not np.array_equal(ids, ref):
                    r.bad[m] += 1
            r.routes["full"][full.last.route] += 1
            r.routes["delta"][delta.last.route] += 1
            if progress is not None:
                progress.advance(task)
    finally:
        for c in (full, delta):
            try:
                c.close()  # END frees the server's state
            except Exception:
                pass


def _replay(mod, url, protocol, sessions, reference, console, timeout_s, server, repeat=1):
    """Warm up, then replay every session ``repeat`` times, one correlation ID per session, pass and mode.

    Returns:
        (results of the timed passes, result of the warm-up pass: verified too, not timed in the table).

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
    results = []
    refs = [[np.asarray(reference.encode(t).ids, dtype=np.int32) for t in turns] for _, turns in sessions]
    try:
        n_turns = sum(len(t) for _, t in sessions)
        columns = (TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("turns"), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True, refresh_per_second=4) as progress:
            # warm-up, untimed but verified: the first requests of each model instance pay lazy setup
            f0, turns0 = sessions[0]
            warm = _SessionResult("warm-up", len(turns0), len(turns0[-1]), len(refs[0][-1]))
            task = progress.add_task("warm-up", total=len(turns0))
            _replay_session(mod, client, kwargs, url, protocol, "warmup", f0, turns0, refs[0], session_timeout,
                            server, warm, progress, task)
            progress.remove_task(task)
            task = progress.add_task("replaying", total=n_turns * repeat)
            for p in range(repeat):
                for i, (f, turns) in enumerate(sessions, 1):
                    progress.update(task, description=f"session {i}/{len(sessions)}"
                                    + (f" pass {p + 1}/{repeat}" if repeat > 1 else ""))
                    if p == 0:
                        results.append(_SessionResult(_label(f), len(turns), len(turns[-1]), len(refs[i - 1][-1])))
                    _replay_session(mod, client, kwargs, url, protocol, f"{i}" + (f"-p{p + 1}" if repeat > 1 else ""),
                                    f, turns, refs[i - 1], session_timeout, server, results[i - 1], progress, task)
    finally:
        try:
            client.close()
        except Exception:
            pass
    return results, warm


def _report(results: list[_SessionResult], warm: _SessionResult, console) -> int:
    """Print the table and one line per mode. Returns the exit code."""
    from rich.table import Table

    def routes(c: Counter) -> str:
        return " ".join(f"{k}:{v}" for k, v in sorted(c.items()))

    def p50(values: list[float]) -> float:
        return _pct(values, 50)

    table = Table(title="served session repair vs served full re-encode: per-turn latency p50, ms (turns after the first)",
                  caption="; ".join(f"{label} = {what}" for _, label, what in MODES))
    heads = ("session", "turns", "final chars", "final ids", "routes (full text)", "repair full-text",
             "repair delta+patch", "full re-encode", "re-encode ÷ repair", "mismatches")
    for h in heads:
        left = h in ("session", "routes (full text)")
        table.add_column(h, justify="left" if left else "right", no_wrap=left)
    for r in results:
        rep, dp, enc = p50(r.ms["full"]), p50(r.ms["delta"]), p50(r.ms["encode"])
        bad = sum(r.bad.values())
        table.add_row(r.name, str(r.turns), f"{r.chars:,}", f"{r.tokens:,}", routes(r.routes["full"]),
                      f"{rep:.3f}", f"{dp:.3f}", f"{enc:.3f}", f"{enc / rep:.2f}x",
                      str(bad) if bad == 0 else f"[bold red]{bad}[/]")
    console.print(table)
    for key, label, _ in MODES:
        later = [x for r in results for x in r.ms[key]]
        first = [x for r in results for x in r.first_ms[key]]
        line = (f"{label + ':':<19} p50 {_pct(later, 50):7.3f} ms  p90 {_pct(later, 90):7.3f} ms  n={len(later)}"
                f"  (first turns p50 {_pct(first, 50):.3f} ms, n={len(first)})")
        if key in ("full", "delta"):
            line += f"  routes {routes(sum((r.routes[key] for r in results), Counter()))}"
        console.print(line + f"  mismatches {sum(r.bad[key] for r in results)}", highlight=False)
    replies = sum(len(r.ms[k]) + len(r.first_ms[k]) for r in [*results, warm] for k, *_ in MODES)
    total_bad = sum(sum(r.bad.values()) for r in [*results, warm])
    what = f"{replies} served replies checked, {sum(len(warm.ms[k]) + len(warm.first_ms[k]) for k, *_ in MODES)} of them warm-up"
    if total_bad == 0:
        console.print(f"[bold green]0 mismatches[/] against the HF reference ({what})")
        return EXIT_OK
    console.print(f"[bold red]{total_bad} MISMATCHES[/] against the HF reference ({what})")
    return EXIT_MISMATCH
