"""Cost of a cold chat turn, simulated: ``bench/chat.py``'s ``ours_delta`` turn and its floor under callgrind.

Wall-clock p50s of one turn move by up to 1.8x between runs of ``bench/chat.py`` on this shared VM (its
``docs/design/chat.md`` section of session 21), far more than most changes to the turn. This script gives the
same comparison without the noise: it runs the turn under valgrind's callgrind with its cache simulator, so
every figure is the same on every run of the same code and inputs.

Each system runs in its own process (the two in parallel), with the conversation, the session and the
tokenizer of ``bench/chat_work.py`` (``chat_work.Turns``): ``--warm`` turns, then ``--turns`` counted turns.
Before each counted turn the process runs a full cyclic-GC collection (so that none runs inside the turn: a
turn allocates fewer containers than the first generation's threshold; ``bench/chat.py``'s p50s leave the
rare turn that collects aside the same way) and writes one byte per 64-byte line of an 8 MB buffer (above the
simulated last level: every turn starts cold, as after ``bench/chat.py``'s check traffic at 1M+ chars), then
calls the system through a ctypes trampoline; callgrind collects only inside it
(``--toggle-collect=_ctypes_callproc``). Systems:

- ``ours_delta``: ``chat.delta_turn`` (``ChatSession.render_more_body``: parse the new messages' JSON and
  render them; then the tokenizer session's ``append`` or ``splice``);
- ``floor``: ``chat.floor_turn`` on the same turn (orjson of the new messages, minijinja's render of them
  alone, gigatoken's encode of the text the turn adds), a lower bound of any exact pipeline.

In both processes every counted turn's reply is checked after the last turn: the text against the jinja2
render, the ids against HF ``tokenizers`` (``add_special_tokens=False``). Not between turns: an HF encode leaves
its worker threads spinning for a while, and callgrind counts every thread's instructions while it collects.

Printed, each the median over the counted turns (every turn is dumped on its own): instructions (Ir), L1
misses (instruction; data read + write), last-level misses (instruction; data), and ``cycles``, KCachegrind's
cycle estimate ``Ir + 10 * L1 misses + 100 * LL misses`` (its default "CEst" formula, without branch
simulation); then ours_delta / floor of each. The simulated caches (``--I1=32768,8,64 --D1=49152,12,64
--LL=2097152,16,64``) are this machine's L1s and a 2 MB last level (its L2 is 1 MB per core; a turn's cold
misses are served from L3 or memory). Slow: about 2 minutes per template at 100K chars, 8 at 1M (valgrind
runs the whole setup and the checks too).

Usage:
    python bench/chat_cost.py
    python bench/chat_cost.py --templates qwen3 --size 1000000
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import anchors as A  # noqa: E402

A.ensure_repo_on_path()

import chat as B  # noqa: E402
import chat_work as W  # noqa: E402

SYSTEMS = ("ours_delta", "floor")
CACHES = ("--I1=32768,8,64", "--D1=49152,12,64", "--LL=2097152,16,64")
SWEEP = 8 << 20  # bytes written before each counted turn (4x the simulated last level)
EVENTS = ("Ir", "Dr", "Dw", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")


def collect(system: str, name: str, size: int, warm: int, turns: int, shared: Path) -> None:
    """The child process (run under callgrind): ``warm`` turns, then ``turns`` turns with ``system`` called
    through the trampoline after the sweep. Raises SystemExit on an inexact reply."""
    import ctypes
    import gc

    import gigatoken
    import numpy as np

    from toktier_backend.chat.fast import MiniJinjaRenderer

    t = W.Turns(name, size, warm + turns, shared)
    mini, giga = MiniJinjaRenderer(t.src, t.specials), gigatoken.Tokenizer(str(t.path))
    sweep = np.zeros(SWEEP, dtype=np.uint8)
    state: dict = {}

    def ours() -> int:
        state["reply"] = B.delta_turn(t.chat, t.tok, state["raw"], t.options)
        return 0

    def floor() -> int:
        B.floor_turn(mini, giga, state["raw"], state["reply"][0].delta)
        return 0

    def cold() -> None:
        gc.collect()
        sweep[::64] += 1

    timed = ctypes.CFUNCTYPE(ctypes.c_int)(ours if system == "ours_delta" else floor)
    replies = []  # checked after the last turn (module docstring)
    for s in range(warm + turns):
        state["raw"] = t.raw(s)
        counted = s >= warm
        if counted and system == "ours_delta":
            cold()
            timed()
        else:
            ours()
        if system == "floor":
            if counted:
                cold()
                timed()
            else:
                floor()
        r, ids = state.pop("reply")
        if counted:
            replies.append((s, B.Reply(r, ids)))
        del ids  # a face drops its view of the reply once the response is written (as bench/chat.py)
    for s, reply in replies:
        t.check(s, reply)


def totals(path: Path) -> dict[str, int]:
    """The event totals of one callgrind output file (its ``events:`` and ``totals:``/``summary:`` lines)."""
    events, values = None, None
    for line in path.read_text().splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith(("totals:", "summary:")):
            values = [int(x) for x in line.split()[1:]]
    if events is None or values is None:
        raise SystemExit(f"{path}: no totals (did valgrind run?)")
    got = dict(zip(events, values))
    return {e: got.get(e, 0) for e in EVENTS}


def cycles(t: dict[str, int]) -> int:
    """KCachegrind's cycle estimate (CEst) without branch simulation."""
    return t["Ir"] + 10 * (t["I1mr"] + t["D1mr"] + t["D1mw"]) + 100 * (t["ILmr"] + t["DLmr"] + t["DLmw"])


def run(name: str, args, shared: Path) -> dict[str, dict[str, float]]:
    """``{system: per-turn medians}`` for one template: both children under callgrind, in parallel, each
    counted turn dumped on its own (``--dump-after``), so a rare turn (one whose token buffer grows, copying its
    ids and ends where the allocator cannot extend the block) is left aside as ``bench/chat.py``'s p50 does."""
    out = Path(tempfile.mkdtemp(prefix="chat_cost_"))
    procs = {}
    for system in SYSTEMS:
        cmd = ["valgrind", "--tool=callgrind", "--cache-sim=yes", *CACHES, "--toggle-collect=_ctypes_callproc",
               "--dump-after=_ctypes_callproc", f"--callgrind-out-file={out / system}.out", sys.executable,
               __file__, "--collect", system, "--templates", name, "--size", str(args.size), "--warm",
               str(args.warm), "--turns", str(args.turns), "--shared", str(shared)]
        procs[system] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    res = {}
    for system, p in procs.items():
        log = p.communicate()[0]
        if p.returncode != 0:
            raise SystemExit(f"{name} {system}: valgrind exited {p.returncode}:\n{log[-2000:]}")
        turns = [totals(out / f"{system}.out.{i}") for i in range(1, args.turns + 1)]
        for t in turns:
            t["cycles"] = cycles(t)
        res[system] = {e: statistics.median(t[e] for t in turns) for e in turns[0]}
    shutil.rmtree(out, ignore_errors=True)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--templates", default="qwen3,llama3_1")
    p.add_argument("--size", type=int, default=100000, help="chars of conversation before the counted turns")
    p.add_argument("--warm", type=int, default=12, help="uncounted turns first (CPython specializes at the 8th call)")
    p.add_argument("--turns", type=int, default=7, help="turns counted (medians)")
    p.add_argument("--shared", default=None)
    p.add_argument("--collect", choices=SYSTEMS, help=argparse.SUPPRESS)  # the child process under callgrind
    args = p.parse_args(argv)
    shared = A.shared_dir(args.shared)
    if args.collect:
        collect(args.collect, args.templates, args.size, args.warm, args.turns, shared)
        return 0
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (Debian: apt-get install valgrind)")
    print(f"# a cold chat turn under callgrind ({' '.join(CACHES)}), median of {args.turns} turns after "
          f"{args.warm} at {args.size} chars, {SWEEP >> 20} MB written before each; revision {A.core_revision()}")
    print(f"{'template':10s} {'system':11s} {'Ir':>10s} {'I1 miss':>8s} {'D1 miss':>8s} {'LL miss I':>9s} "
          f"{'LL miss D':>9s} {'cycles':>10s}")
    for name in args.templates.split(","):
        res = run(name, args, shared)
        for system in SYSTEMS:
            f = res[system]
            print(f"{name:10s} {system:11s} {f['Ir']:10,.0f} {f['I1mr']:8,.0f} {f['D1mr'] + f['D1mw']:8,.0f} "
                  f"{f['ILmr']:9,.0f} {f['DLmr'] + f['DLmw']:9,.0f} {f['cycles']:10,.0f}")
        o, fl = res["ours_delta"], res["floor"]
        print(f"{name:10s} {'ours/floor':11s} {o['Ir'] / fl['Ir']:10.2f} {o['I1mr'] / fl['I1mr']:8.2f} "
              f"{(o['D1mr'] + o['D1mw']) / (fl['D1mr'] + fl['D1mw']):8.2f} {o['ILmr'] / fl['ILmr']:9.2f} "
              f"{(o['DLmr'] + o['DLmw']) / (fl['DLmr'] + fl['DLmw']):9.2f} {o['cycles'] / fl['cycles']:10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
