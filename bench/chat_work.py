"""Work per chat turn, counted: the Python bytecodes, calls and code objects of one ``ours_delta`` turn.

The turn is ``bench/chat.py``'s ``ours_delta`` (the same conversation, the same two new messages per turn):
``ChatSession.render_more_body`` of the new messages' JSON (parsed, then rendered), then the tokenizer
session's ``append`` (``splice`` when the render does not extend the previous text). After ``--warm`` untimed
turns (CPython 3.11 specializes a code object at its 8th call: fewer warm turns would count that too),
``--turns`` turns run under ``sys.settrace`` with ``f_trace_opcodes`` and are counted: bytecodes executed,
Python calls, distinct code objects and the bytes they hold (``co_code`` plus 8 per constant and name: the
part of them a turn can read), per file and, with ``--top N``, per function.

Counts, not times: they are the same on every run of the same code and inputs (whatever the machine is
doing), so they show what a change removes from a turn; ``docs/design/chat.md`` (session 20) has them per
commit and what a cold turn's time is made of. Each counted turn is checked first: its text against the
jinja2 reference render, its ids against HF ``tokenizers`` (``add_special_tokens=False``).

Usage:
    python bench/chat_work.py
    python bench/chat_work.py --templates qwen3 --top 30
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import anchors as A  # noqa: E402

A.ensure_repo_on_path()

import chat as B  # noqa: E402

from tests.chat import corpus as C  # noqa: E402


class Turns:
    """The ``ours_delta`` turns of ``bench/chat.py`` for one template and size, ready to run: the conversation
    (``conv``; the timed messages from ``start`` on, two per turn), the render ``options``, the warm session
    (``chat``: the conversation before the first turn rendered, untimed) and its tokenizer session (``tok``,
    its first text indexed), the jinja2 reference (``ref``) and HF ``tokenizers`` (``hf``) for the checks.
    Shared by this script and ``bench/chat_cost.py``."""

    def __init__(self, name: str, size: int, turns: int, shared: Path):
        from tokenizers import Tokenizer

        from toktier_backend import load_tokenizer
        from toktier_backend.chat.session import ChatSession
        from toktier_backend.chat.template import ChatRenderer, special_tokens

        self.name, self.size = name, size
        self.src, cfg = C.template_source(name)
        self.specials = special_tokens(cfg)
        self.options = {"add_generation_prompt": True}
        if name in C.TOOL_TEMPLATES:
            self.options["tools"] = B.TOOLS
        self.conv, self.start = B.conversation(name, size, turns)
        self.path = shared / "tokenizers" / name / "tokenizer.json"
        self.ref, self.hf = ChatRenderer(self.src, self.specials), Tokenizer.from_file(str(self.path))
        self.chat = ChatSession(self.src, self.specials)
        self.tok = load_tokenizer(str(self.path)).session(add_special_tokens=False)
        first = self.conv[:self.start - 2]
        self.tok.update(self.chat.render(first, **self.options).text)
        B._settle(self.tok)
        self._prev = len(first)

    def end(self, s: int) -> int:
        """Messages in the request of turn ``s`` (0-based)."""
        return self.start + 2 * (s + 1)

    def raw(self, s: int) -> bytes:
        """Turn ``s``'s body: the JSON array of the messages its request adds (turns are taken in order)."""
        end = self.end(s)
        raw = B._dumps(self.conv[self._prev:end])
        self._prev = end
        return raw

    def check(self, s: int, reply: "B.Reply") -> None:
        """Raise SystemExit unless turn ``s``'s reply (``chat.Reply``: kept after the turn, checked any time
        later) has the jinja2 render's text and HF's ids."""
        text = self.ref.render(self.conv[:self.end(s)], **self.options)
        want = np.asarray(self.hf.encode(text, add_special_tokens=False).ids, dtype=np.int64)
        if not reply.same(text, want):
            raise SystemExit(f"{self.name} {self.size}: turn {s} is INEXACT")


def count(name: str, size: int, warm: int, turns: int, shared: Path) -> dict:
    """``{"bytecodes", "calls", "functions", "code_bytes", "by_file", "by_function"}``, per turn."""
    t = Turns(name, size, warm + turns, shared)
    ops: Counter = Counter()
    calls: Counter = Counter()

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            ops[frame.f_code] += 1
        elif event == "call":
            calls[frame.f_code] += 1
        return trace

    for s in range(warm + turns):
        raw = t.raw(s)
        counted = s >= warm
        if counted:
            sys.settrace(trace)
        r, ids = B.delta_turn(t.chat, t.tok, raw, t.options)
        sys.settrace(None)
        if counted:
            t.check(s, B.Reply(r, ids))
        del ids  # a face drops its view of the reply once the response is written (as bench/chat.py)
    by_file: Counter = Counter()
    by_function: Counter = Counter()
    for code, n in ops.items():
        where = Path(code.co_filename).name
        by_file[where] += n / turns
        by_function[f"{where}:{code.co_name}:{code.co_firstlineno}"] += n / turns
    code_bytes = sum(len(c.co_code) + 8 * (len(c.co_consts) + len(c.co_names)) for c in ops)
    return {"bytecodes": sum(ops.values()) / turns, "calls": sum(calls.values()) / turns, "functions": len(ops),
            "code_bytes": code_bytes, "by_file": by_file, "by_function": by_function}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--templates", default="qwen3,llama3_1")
    p.add_argument("--size", type=int, default=100000, help="chars of conversation before the counted turns")
    p.add_argument("--warm", type=int, default=15, help="untimed turns first (CPython specializes at the 8th call)")
    p.add_argument("--turns", type=int, default=5, help="turns counted")
    p.add_argument("--top", type=int, default=0, help="also print the N functions with most bytecodes")
    p.add_argument("--shared", default=None)
    args = p.parse_args(argv)
    shared = A.shared_dir(args.shared)
    print(f"# work per ours_delta turn at {args.size} chars, {args.turns} turns after {args.warm}; "
          f"revision {A.core_revision()}")
    for name in args.templates.split(","):
        w = count(name, args.size, args.warm, args.turns, shared)
        print(f"{name}: {w['bytecodes']:.0f} bytecodes, {w['calls']:.0f} calls, {w['functions']} code objects "
              f"({w['code_bytes'] // 1024} KiB), exact")
        print("  " + ", ".join(f"{f} {n:.0f}" for f, n in w["by_file"].most_common(8)))
        for fn, n in w["by_function"].most_common(args.top):
            print(f"    {n:7.0f}  {fn}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
