"""Fresh full-encode benchmark (skeleton): one whole document, no session state, ours vs the anchors.

Per tokenizer and size (chars), ``--samples`` different texts (windows of the SWE-agent corpus rendered
as ChatML, each starting at a different offset, so no system can serve one from a cache) are encoded by:

- ``hf``: HF ``tokenizers`` ``encode(text, add_special_tokens=False)``, serial (the reference);
- ``gigatoken``: ``gigatoken.Tokenizer.encode`` (it parallelizes one large document across cores);
- ``fastokens``: ``encode_batch_flat([text])``, segment cache off (unsupported for cl100k/o200k);
- ``ours``: ``toktier_backend`` ``Tokenizer.encode(text, add_special_tokens=False)``, serial.

All columns are the core stream. Exactness first: every column is compared with HF on each sample HF ran
on (the first ``--hf-samples``); a column with a mismatch is printed as INEXACT.

TODO (later issue): ours parallel (chunked at stable cuts on a shared pool) and a mixed-load run
(full encodes competing with session appends).

Usage:
    python bench/full_encode.py --tokenizers qwen3 --sizes 100000,1000000,4000000 --samples 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import anchors as A  # noqa: E402
from repair import timed  # noqa: E402

A.ensure_repo_on_path()

SYSTEMS = ("ours", "gigatoken", "fastokens", "hf")
STRIDE = 7919  # chars between the starts of consecutive samples


def sample_texts(size: int, n: int, folder: Path) -> list[str]:
    """``n`` texts of ``size`` chars, each a window of the corpus starting ``STRIDE`` chars after the last."""
    from toktier_backend import corpus

    big = corpus.long_session_text(size + n * STRIDE, folder)
    return [big[k * STRIDE: k * STRIDE + size] for k in range(n)]


def run_size(systems: dict, texts: list[str], hf_samples: int) -> dict:
    ms = {k: [] for k in systems}
    checked = {k: 0 for k in systems}
    bad = {k: 0 for k in systems}
    for k, text in enumerate(texts):
        got = {}
        for name, encode in systems.items():
            if name == "hf" and k >= hf_samples:
                continue
            t, got[name] = timed(lambda: encode(text))
            ms[name].append(t)
        if "hf" in got:
            for name, ids in got.items():
                if name == "hf":
                    continue
                checked[name] += 1
                at = A.first_mismatch(ids, got["hf"])
                if at is not None:
                    bad[name] += 1
                    print(f"  MISMATCH {name} vs hf: sample {k} ({len(text)} chars): first diff at id {at}",
                          flush=True)
    return {name: {"n": len(v), "p50_ms": A.percentile(v, 50), "p90_ms": A.percentile(v, 90),
                   "samples_ms": v, "checked": checked[name], "mismatches": bad[name]}
            for name, v in ms.items() if v}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizers", default="qwen3,llama3_1,deepseek_v3,gpt2")
    p.add_argument("--sizes", default="100000,1000000,4000000", help="document sizes, chars")
    p.add_argument("--samples", type=int, default=8, help="texts per size (ours, gigatoken, fastokens)")
    p.add_argument("--hf-samples", type=int, default=3, help="of those, how many HF encodes (and checks)")
    p.add_argument("--shared", default=None, help="shared folder (default <repo>/../shared)")
    p.add_argument("--out", default="bench/out")
    args = p.parse_args(argv)

    shared = A.shared_dir(args.shared)
    folder = shared / "corpus" / "swe-agent"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "bench": "full_encode",
        "args": vars(args),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "checkout": A.core_revision(),
        "versions": {m: A._version(m) for m in ("toktier_backend", "tokenizers", "gigatoken", "fastokens")},
        "tokenizers": {},
    }
    t0 = time.perf_counter()
    for name in args.tokenizers.split(","):
        path = A.tokenizer_path(name, shared)
        print(f"\n=== {name} ({path})", flush=True)
        anchors = [A.ours(path), A.gigatoken(path), A.fastokens(path), A.hf(path)]
        systems = {a.name: a.encode for a in anchors if a.encode is not None}
        skipped = {a.name: a.reason for a in anchors if a.encode is None}
        for k, why in skipped.items():
            print(f"  {k}: skipped: {why}")
        entry = {"path": str(path), "skipped": skipped, "sizes": {}}
        for size in (int(x) for x in args.sizes.split(",")):
            r = run_size(systems, sample_texts(size, args.samples, folder), args.hf_samples)
            entry["sizes"][str(size)] = r
            ours = r.get("ours", {}).get("p50_ms")
            print(f"\n{name} @ {size:,} chars")
            print(f"  {'system':<10} {'n':>3} {'p50 ms':>10} {'p90 ms':>10} {'x ours p50':>11}  exact")
            for key in SYSTEMS:
                if key not in r:
                    continue
                v = r[key]
                exact = "reference" if key == "hf" else (
                    "unchecked" if not v["checked"] else
                    "yes" if not v["mismatches"] else f"INEXACT {v['mismatches']}/{v['checked']}")
                ratio = f"{A.fmt_ratio(v['p50_ms'] / ours):>10}x" if ours and key != "ours" else f"{'':>11}"
                print(f"  {key:<10} {v['n']:>3} {v['p50_ms']:>10.2f} {v['p90_ms']:>10.2f} {ratio}  {exact}",
                      flush=True)
        results["tokenizers"][name] = entry
    results["wall_s"] = time.perf_counter() - t0
    (out_dir / "full_encode.json").write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out_dir / 'full_encode.json'} ({results['wall_s']:.0f} s)")
    bad = sum(v.get("mismatches", 0) for e in results["tokenizers"].values()
              for r in e["sizes"].values() for v in r.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
