"""Session repair benchmark: one ~1.5K-char append to a long real agent session, ours vs the anchors.

For each tokenizer and context size (chars), a session text is built from the SWE-agent corpus
(trajectories rendered as ChatML, concatenated and repeated, cut back to the last turn boundary), then
``--samples`` whole next turns of 1.0K-2.5K chars, taken from the corpus trajectories, are appended one
after another to that *growing* session. Each system runs all samples in turn (ours, toktier,
gigatoken, then HF), one at a time, on the same texts:

- ``ours``: ``Session.append(delta)`` on a session warmed with ``update(base)`` (returns all ids); the caller
  copies each reply (untimed) and drops it before the next call;
- ``ours_keep``: the same on a second session, the caller keeping every reply it was given (no copy): replies
  are never changed by later calls, so the buffer copies on write when a held reply would see a change;
- ``toktier``: toktier 0.3.0 session append (``tok.encode(transcript, session=id)``), where it runs;
- ``gigatoken``: full re-encode of the whole new text;
- ``hf``: HF ``tokenizers`` full re-encode of the whole new text (the reference).

Exactness first: ours and each anchor are compared with HF on every sample HF ran on (all of them under
the default ``--verify hf``); a column with a mismatch is printed as INEXACT. Output: a table on stdout,
``<out>/repair.json`` and ``<out>/repair.png`` (p50 latency vs context size, log-log).

Usage:
    python bench/repair.py                                  # qwen3,llama3_1,deepseek_v3,gpt2 x 100K,1M,3M
    python bench/repair.py --tokenizers qwen3 --sizes 100000,1000000 --samples 24 --verify gigatoken
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import anchors as A  # noqa: E402

A.ensure_repo_on_path()

SYSTEMS = ("ours", "ours_keep", "toktier", "gigatoken", "hf")
LABELS = {
    "ours": "ours Session.append",
    "ours_keep": "ours, caller keeps replies",
    "toktier": "toktier 0.3.0 session append",
    "gigatoken": "gigatoken full re-encode",
    "hf": "HF full re-encode",
}
COLORS = {"ours": "tab:blue", "ours_keep": "tab:purple", "toktier": "tab:orange", "gigatoken": "tab:green",
          "hf": "tab:red"}


# -- corpus ---------------------------------------------------------------------------------------

def session_base(n_chars: int, folder: Path) -> str:
    """About ``n_chars`` chars of real sessions, ending at a turn boundary (``<|im_end|>\\n``)."""
    from toktier_backend import corpus

    text = corpus.long_session_text(n_chars, folder)
    end = text.rfind("<|im_end|>\n")
    return text[: end + len("<|im_end|>\n")] if end > 0 else text


def turn_deltas(folder: Path, lo: int = 1000, hi: int = 2500) -> list[str]:
    """Whole next-turn texts (what an agent appends) of ``lo..hi`` chars, interleaved across trajectories."""
    from toktier_backend import corpus

    per_file = []
    for path in corpus.trajectory_files(folder):
        turns = corpus.load_turns(path)
        deltas = [b[len(a):] for a, b in zip([""] + turns[:-1], turns)]
        per_file.append([d for d in deltas if lo <= len(d) <= hi])
    out, i = [], 0
    while any(i < len(f) for f in per_file):  # round-robin: consecutive samples come from different files
        out.extend(f[i] for f in per_file if i < len(f))
        i += 1
    if not out:
        raise RuntimeError(f"no turns of {lo}..{hi} chars in {folder}")
    return out


# -- timing ---------------------------------------------------------------------------------------

def timed(fn):
    """``(ms, result)`` of one call; a full collection before, the collector off during the call."""
    gc.collect()
    gc.disable()
    try:
        return A.timed(fn)
    finally:
        gc.enable()


def summary(ms: list[float]) -> dict:
    return {"n": len(ms), "p50_ms": A.percentile(ms, 50), "p90_ms": A.percentile(ms, 90), "samples_ms": ms}


def core_ids(encoding) -> np.ndarray:
    """The core stream of an HF ``Encoding``: drop what the post-processor added (sequence id ``None``)."""
    keep = np.fromiter((s is not None for s in encoding.sequence_ids), dtype=bool, count=len(encoding.ids))
    return np.asarray(encoding.ids, dtype=np.int64)[keep]


# -- one tokenizer x one size -------------------------------------------------------------------

def run_size(ctx: dict, size: int, deltas: list[str], args) -> dict:
    tok, ref, giga, tts = ctx["ours"], ctx["ref"], ctx["gigatoken"], ctx["toktier"]
    base = session_base(size, ctx["corpus"])
    warm, samples = deltas[-1], [deltas[i % (len(deltas) - 1)] for i in range(args.samples)]
    hf_runs = set(range(args.samples)) if args.verify == "hf" else set(range(min(args.hf_samples, args.samples)))
    special = args.add_special_tokens

    # Open every session on the same base, then one untimed warm-up append each (same delta for all).
    s = tok.session(add_special_tokens=special)
    update_ms, _ = timed(lambda: s.update(base))
    s.append(warm)
    s_keep = tok.session(add_special_tokens=special)
    s_keep.update(base)
    s_keep.append(warm)
    tt_start_ms = None
    if tts is not None:
        tt_start_ms, _ = timed(lambda: tts.start(base))
        tts.append(warm)
    text = base + warm

    # One system at a time over the same samples (as tiktoken's benchmark does per library): a 3M-char
    # HF encode (the reference, or toktier's llama3_1 route) churns hundreds of MB and made the next call
    # of any system several times slower than it runs alone. Ids are copied, untimed, for the checks.
    ms = {k: [] for k in SYSTEMS}
    got = {k: [] for k in ("ours", "ours_keep", "toktier", "gigatoken")}
    routes, tt_routes = Counter(), Counter()
    for delta in samples:  # ours: the caller copies the reply and drops it before the next call
        t, ids = timed(lambda: s.append(delta))
        ms["ours"].append(t)
        got["ours"].append(np.array(ids, dtype=np.int32))
        del ids
        routes[str(s.last_repair.route)] += 1
    for delta in samples:  # ours_keep: the caller holds every reply; they are checked against HF at the end
        t, ids = timed(lambda: s_keep.append(delta))
        ms["ours_keep"].append(t)
        got["ours_keep"].append(ids)
    del ids
    ends = []
    for delta in samples:
        text += delta
        ends.append(len(text))
    if tts is not None:
        for delta in samples:
            t, ids = timed(lambda: tts.append(delta))
            ms["toktier"].append(t)
            got["toktier"].append(np.array(ids, dtype=np.int32))
            tt_routes[tts.route()] += 1
    if giga is not None:
        for end in ends:
            sample_text = text[:end]
            t, ids = timed(lambda: giga(sample_text))
            ms["gigatoken"].append(t)
            got["gigatoken"].append(ids)
    final_ids = len(got["ours"][-1])

    # Phase 2: the reference. HF full re-encode of each sample's text (timed), and every check.
    bad, checked = Counter(), Counter()
    for k in range(len(samples)):
        if k in hf_runs:
            t, enc = timed(lambda: ref.encode(text[: ends[k]], add_special_tokens=special))
            ms["hf"].append(t)
            want_ours = np.asarray(enc.ids, dtype=np.int64)
            want_core = core_ids(enc) if special else want_ours
            against = "hf"
            del enc
        else:  # --verify gigatoken: gigatoken stands in (it is checked against HF on the HF samples)
            want_ours = want_core = np.asarray(got["gigatoken"][k], dtype=np.int64)  # special is off here
            against = "gigatoken"
        for name, want in (("ours", want_ours), ("ours_keep", want_ours), ("toktier", want_core),
                           ("gigatoken", want_core)):
            if not got[name] or (name == "gigatoken" and against == "gigatoken"):
                continue
            checked[name] += 1
            ids = got[name][k]
            at = A.first_mismatch(ids, want)
            if at is not None:
                bad[name] += 1
                print(f"  MISMATCH {name} vs {against}: {ctx['name']} {size} sample {k}: first diff at id {at} "
                      f"got {list(np.asarray(ids)[at:at + 5])} want {list(want[at:at + 5])} "
                      f"(len {len(ids)} vs {len(want)})", flush=True)

    out = {
        "base_chars": len(base),
        "final_chars": len(text),
        "final_ids": int(final_ids),
        "append_chars": {"p50": A.percentile([len(d) for d in samples], 50),
                         "min": min(map(len, samples)), "max": max(map(len, samples))},
        "ours_update_ms": update_ms,
        "toktier_start_ms": tt_start_ms,
        "ours_routes": dict(routes),
        "toktier_routes": dict(tt_routes),
        "verified_against": args.verify,
        "systems": {},
    }
    for name in SYSTEMS:
        if ms[name]:
            out["systems"][name] = {**summary(ms[name]), "checked": checked[name], "mismatches": bad[name]}
    return out


# -- report ---------------------------------------------------------------------------------------

def ratios(systems: dict) -> dict:
    ours = systems.get("ours", {}).get("p50_ms")
    return {f"{k}_p50/ours_p50": (v["p50_ms"] / ours if ours else None)
            for k, v in systems.items() if k != "ours"}


def print_size(name: str, size: int, r: dict) -> None:
    print(f"\n{name} @ {size:,} chars (base {r['base_chars']:,} -> {r['final_chars']:,} chars, "
          f"{r['final_ids']:,} ids; appends p50 {r['append_chars']['p50']:.0f} chars; "
          f"ours update(base) {r['ours_update_ms']:.0f} ms"
          + (f", toktier start {r['toktier_start_ms']:.0f} ms" if r["toktier_start_ms"] is not None else "") + ")")
    print(f"  {'system':<30} {'n':>3} {'p50 ms':>10} {'p90 ms':>10} {'x ours p50':>11}  exact")
    ours = r["systems"].get("ours", {}).get("p50_ms")
    for key, v in r["systems"].items():
        exact = "n/a" if not v["checked"] else ("yes" if not v["mismatches"] else
                                                  f"INEXACT {v['mismatches']}/{v['checked']}")
        if key == "hf":
            exact = "reference"
        ratio = f"{A.fmt_ratio(v['p50_ms'] / ours):>10}x" if ours and key != "ours" else f"{'':>11}"
        print(f"  {LABELS[key]:<30} {v['n']:>3} {v['p50_ms']:>10.2f} {v['p90_ms']:>10.2f} {ratio}  {exact}")
    print(f"  ours routes: {r['ours_routes']}" + (f"; toktier routes: {r['toktier_routes']}" if r["toktier_routes"] else ""))


def plot(results: dict, path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["tokenizers"])
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.8), squeeze=False, sharey=True)
    handles = {}
    for ax, name in zip(axes[0], names):
        sizes = results["tokenizers"][name]["sizes"]
        xs = sorted(sizes, key=int)
        for key in SYSTEMS:
            pts = [((sizes[x]["base_chars"] + sizes[x]["final_chars"]) / 2, sizes[x]["systems"][key])
                   for x in xs if key in sizes[x]["systems"]]  # x: mean context over the growing session
            if not pts:
                continue
            x = [p[0] for p in pts]
            handles[key], = ax.plot(x, [p[1]["p50_ms"] for p in pts], marker="o", label=LABELS[key],
                                    color=COLORS[key])
            ax.fill_between(x, [p[1]["p50_ms"] for p in pts], [p[1]["p90_ms"] for p in pts],
                            color=COLORS[key], alpha=0.15)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ticks = [(sizes[x]["base_chars"] + sizes[x]["final_chars"]) / 2 for x in xs]
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(ticks, [f"{t / 1e6:.2g}M" if t >= 1e6 else f"{t / 1e3:.0f}K" for t in ticks])
        ax.set_title(name)
        ax.set_xlabel("session context (chars, mean over samples)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("ms per ~1.5K-char append\n(p50; band to p90)")
    keys = [k for k in SYSTEMS if k in handles]
    fig.legend([handles[k] for k in keys], [LABELS[k] for k in keys], loc="lower center", ncol=len(keys),
               fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main -----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizers", default="qwen3,llama3_1,deepseek_v3,gpt2")
    p.add_argument("--sizes", default="100000,1000000,3000000", help="session context sizes, chars")
    p.add_argument("--samples", type=int, default=24, help="timed appends per size (ours, toktier, gigatoken)")
    p.add_argument("--hf-samples", type=int, default=5,
                   help="HF full re-encodes per size under --verify gigatoken (under --verify hf: every sample)")
    p.add_argument("--verify", choices=("hf", "gigatoken"), default="hf",
                   help="hf: HF encodes every sample (exact check everywhere; slow at 3M). gigatoken: HF on "
                        "--hf-samples samples, the rest checked against gigatoken")
    p.add_argument("--add-special-tokens", action=argparse.BooleanOptionalAction, default=True,
                   help="ours and the HF reference with the post-processor (anchors: core stream)")
    p.add_argument("--no-toktier", action="store_true", help="skip the toktier 0.3.0 anchor")
    p.add_argument("--shared", default=None, help="shared folder (default <repo>/../shared)")
    p.add_argument("--out", default="bench/out")
    args = p.parse_args(argv)
    if args.verify == "gigatoken" and args.add_special_tokens:
        p.error("--verify gigatoken compares core streams: add --no-add-special-tokens")

    import toktier_backend as tt

    shared = A.shared_dir(args.shared)
    folder = shared / "corpus" / "swe-agent"
    deltas = turn_deltas(folder)
    sizes = [int(x) for x in args.sizes.split(",")]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "bench": "repair",
        "args": vars(args),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "checkout": A.core_revision(),
        "module": tt.__file__,
        "versions": {m: A._version(m) for m in ("toktier_backend", "tokenizers", "gigatoken", "toktier")},
        "session_mode": "one growing session per size: update(base), 1 untimed warm-up append, then "
                        "--samples timed appends, each to the text the previous one produced; systems run "
                        "one after another over the same samples (ours, toktier, gigatoken, hf)",
        "tokenizers": {},
    }
    t_start = time.perf_counter()
    print(f"toktier_backend from {tt.__file__} (checkout {results['checkout']})", flush=True)
    for name in args.tokenizers.split(","):
        path = A.tokenizer_path(name, shared)
        print(f"\n=== {name} ({path})", flush=True)
        tok = tt.load_tokenizer(path)
        giga = A.gigatoken(path)
        if giga.encode is None:
            print(f"  gigatoken unavailable: {giga.reason}")
        tts, tt_reason = None, ""
        family = A.TOKTIER_FAMILIES.get(name)
        if args.no_toktier:
            tt_reason = "--no-toktier"
        elif family is None:
            tt_reason = f"not in toktier 0.3.0's roster (families: {sorted(A.TOKTIER_FAMILIES.values())})"
        else:
            try:
                tts = A.toktier_session_append(family, path)
            except A.AnchorUnavailable as e:
                tt_reason = str(e)
        if tts is None:
            print(f"  toktier: skipped: {tt_reason}")
        ctx = {"name": name, "ours": tok, "ref": tok.reference, "gigatoken": giga.encode, "toktier": tts,
               "corpus": folder}
        entry = {"path": str(path), "toktier_family": family if tts else None, "toktier_skipped": tt_reason,
                 "gigatoken_skipped": giga.reason, "sizes": {}}
        for size in sizes:
            r = run_size(ctx, size, deltas, args)
            r["ratios"] = ratios(r["systems"])
            entry["sizes"][str(size)] = r
            print_size(name, size, r)
            sys.stdout.flush()
        results["tokenizers"][name] = entry
        (out_dir / "repair.json").write_text(json.dumps(results, indent=1))
    results["wall_s"] = time.perf_counter() - t_start
    (out_dir / "repair.json").write_text(json.dumps(results, indent=1))
    plot(results, out_dir / "repair.png")

    print("\nSummary: p50 ratios (>1: ours faster); mismatches vs HF (must be 0)")
    total_bad = 0
    for name, entry in results["tokenizers"].items():
        for size, r in entry["sizes"].items():
            rs = "  ".join(f"{k.split('_p50')[0]}/ours={A.fmt_ratio(v)}x" for k, v in r["ratios"].items() if v)
            mm = {k: v["mismatches"] for k, v in r["systems"].items() if k != "hf"}
            total_bad += mm.get("ours", 0) + mm.get("ours_keep", 0)
            print(f"  {name:<12} {int(size):>9,}  ours p50 {r['systems']['ours']['p50_ms']:8.2f} ms  {rs}  "
                  f"mismatches {mm}")
    print(f"\nwrote {out_dir / 'repair.json'}, {out_dir / 'repair.png'} ({results['wall_s']:.0f} s)")
    return 1 if total_bad else 0


if __name__ == "__main__":
    sys.exit(main())
