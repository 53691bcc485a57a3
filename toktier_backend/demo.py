"""``toktier demo``: replay real agent sessions turn by turn and prove every reply exact.

Each trajectory becomes a session: turn ``i`` sends the whole conversation so far (full-text mode, as
coding agents do). For every turn we time the session repair and a full re-encode of the same text, and
compare the repaired ids with the HF reference. The table ends with the mismatch count, which must be 0.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np


def run_local(tokenizer_spec: str | None, sessions_dir: str | None, *, console=None) -> int:
    """Replay sessions through the library (no server). Returns the number of mismatches."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from .api import load_tokenizer
    from .corpus import load_turns, trajectory_files

    console = console or Console()
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
            table.add_row(f.stem[-38:], str(len(turns)), f"{len(turns[-1]):,}", f"{p50r:.3f}", f"{p50f:.3f}",
                          f"{p50f / p50r:.1f}x", " ".join(f"{k}:{v}" for k, v in routes.items()), str(bad))
    console.print(table)
    if all_rep:
        console.print(f"all turns after the first: repair p50 {np.median(all_rep):.3f} ms, p90 "
                      f"{np.percentile(all_rep, 90):.3f} ms; full re-encode p50 {np.median(all_full):.3f} ms "
                      f"(n={len(all_rep)})")
    console.print(f"[bold]{'0 mismatches' if total_bad == 0 else f'{total_bad} MISMATCHES'}[/] against the HF reference")
    return total_bad
