"""Run the GPU kernels on numba's CUDA simulator and compare them with HF and with the NumPy twin.

Run as a script (``tests/gpu/test_simulator.py`` starts it in a subprocess with
``NUMBA_ENABLE_CUDASIM=1`` so numba is imported in simulator mode whatever else the test session
imported). Prints one JSON object: per check, the mismatches found (expected: none).

Usage: ``NUMBA_ENABLE_CUDASIM=1 python tests/gpu/_sim_check.py NAME [NAME...]`` with NAME a folder of
``shared/tokenizers`` or ``synthetic`` (adversarial merge ranks, see ``synthetic_tokenizer``).
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run with NUMBA_ENABLE_CUDASIM=1"
import faulthandler  # noqa: E402

#: A check that runs past this many seconds (normally 5-15 s per file) dumps every thread's stack to stderr
#: and exits 1, so a hang in the simulator shows where it hangs instead of waiting out the caller's timeout.
HANG_S = float(os.environ.get("TOKTIER_SIM_HANG_S", "240"))
faulthandler.dump_traceback_later(HANG_S, exit=True)
sys.setswitchinterval(2e-4)  # simulated threads hand the GIL over 25x faster: ~8x faster syncthreads

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("TOKTIER_SHARED", REPO.parent / "shared"))

import numpy as np  # noqa: E402
import tokenizers  # noqa: E402

from toktier_backend.corpus import load_turns, trajectory_files  # noqa: E402
from toktier_backend.gpu.engine import GpuEngine  # noqa: E402
from toktier_backend.gpu.tables import pretokenize_numpy  # noqa: E402

#: Traps (contractions, digit groups, whitespace/CRLF runs, glue prefixes, CJK, marks, X chars, a long
#: space run and a long '=' run for the block path) and added tokens of every family, kept tiny: the
#: simulator runs each CUDA thread as a Python thread.
TEXTS = [
    "It's 'S 'll x'Re  \n\n 12345 a.b ..c\t.d é\u00a0x",
    "def f(x):\n    return x->y + 2025  # it's\r\n\r\n",
    "中文字符测试，日本語のテキスト。한국어",
    "ſ ' \u200dab 👍🏽 «»$ .aé !Ab \u3000z",
    " " * 40 + "z" + "=" * 37,
    "<|endoftext|><|im_start|>user\nhi<|im_end|>\n<｜User｜>x<|begin_of_text|>",
    "cafe\u0301",  # not NFC: Qwen takes the CPU route
]


def corpus_snippets(k: int, length: int) -> list[str]:
    texts = [load_turns(f)[-1] for f in trajectory_files(SHARED / "corpus" / "swe-agent")]
    rng = random.Random(7)
    out = []
    for _ in range(k):
        t = rng.choice(texts)
        a = rng.randrange(max(1, len(t) - length))
        out.append(t[a : a + length])
    return out


def synthetic_tokenizer(path: Path, seed: int = 3) -> None:
    """A byte-level (GPT-2 pre-tokenizer) BPE over the letters ``abc`` whose merge ranks are shuffled, so
    merges create pairs of *lower* rank than their parts (the rounds' inversion rule) and long runs
    take the block path."""
    from toktier_backend.spec import bytes_to_unicode

    rng = random.Random(seed)
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: i for i, b in enumerate(range(256))}
    toks = ["a", "b", "c"]
    merges = []
    while len(merges) < 40:
        a, b = rng.choice(toks), rng.choice(toks)
        if a + b in vocab or len(a + b) > 6:
            continue
        vocab[a + b] = len(vocab)
        toks.append(a + b)
        merges.append(f"{a} {b}")
    rng.shuffle(merges)
    merges = [m for m in merges if all(x in vocab for x in m.split(" "))]
    cfg = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None, "decoder": None,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                  "merges": merges},
    }
    path.write_text(json.dumps(cfg))


def check(name: str) -> dict:
    t0 = time.perf_counter()
    if name == "synthetic":
        tmp = Path(tempfile.mkdtemp()) / "tokenizer.json"
        synthetic_tokenizer(tmp)
        path = tmp
        rng = random.Random(11)
        texts = ["".join(rng.choice("abc") for _ in range(rng.randint(2, 30))) for _ in range(10)]
        texts += ["".join(rng.choice("ab") for _ in range(rng.randint(33, 70))) for _ in range(3)]
        texts += [" ".join(texts[:4]), "a" * 45]
    else:
        path = SHARED / "tokenizers" / name / "tokenizer.json"
        texts = TEXTS + corpus_snippets(1, 60)
    ref = tokenizers.Tokenizer.from_file(str(path))
    engine = GpuEngine(str(path))
    accepted = [t for t in texts if engine.accepts(t)]
    got = engine.encode_batch(accepted)
    # the same pass's predicate output vs the NumPy predicates (added-token segments included)
    sc = engine._last
    ncp = int(sc.h_counts[2])
    kstart = sc.start[0, :ncp].copy_to_host().astype(bool)
    nlong, nshort = int(sc.h_counts[5]), int(sc.h_counts[4])
    want_start = np.concatenate([pretokenize_numpy(engine.tables, t)[1] for t in accepted])
    id_bad = [t for t, g in zip(accepted, got) if g.tolist() != ref.encode(t, add_special_tokens=False).ids]
    pred_bad = np.flatnonzero(kstart != want_start).tolist()
    # one text alone (no batch segments) and the CPU route for texts the GPU does not accept
    single = engine.encode(accepted[0]).tolist() == ref.encode(accepted[0], add_special_tokens=False).ids
    rejected = [t for t in texts if not engine.accepts(t)]
    rej_bad = [t for t in rejected if engine.encode(t).tolist() != ref.encode(t, add_special_tokens=False).ids]
    return {
        "name": name, "family": engine.tables.family, "texts": len(accepted), "rejected": len(rejected),
        "ids_mismatch": id_bad, "starts_mismatch_positions": pred_bad[:20], "single_ok": single,
        "rejected_mismatch": rej_bad, "stats": engine.stats, "seconds": round(time.perf_counter() - t0, 1),
        "ntokens": int(sum(len(g) for g in got)), "nshort": nshort, "nlong": nlong,
    }


if __name__ == "__main__":
    results = []
    for n in sys.argv[1:]:
        results.append(check(n))
        print(f"sim check {n}: {results[-1]['seconds']} s", file=sys.stderr, flush=True)
    print(json.dumps(results))
