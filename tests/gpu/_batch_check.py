"""Batches of ``GpuRouter.encode_many`` over the real ``GpuEngine`` on numba's CUDA simulator.

Run as a script (``tests/gpu/test_batch_simulator.py`` starts it in a subprocess with
``NUMBA_ENABLE_CUDASIM=1``). Prints one JSON list, per tokenizer: ``{"name", "batches": [{"max_queue",
"texts", "results": [[ids, route] or "error: ..."], "passes"}], "stats", "seconds"}``. Expected ids are
computed by the test, not here.

Usage: ``NUMBA_ENABLE_CUDASIM=1 python tests/gpu/_batch_check.py CROSSOVER BATCHES_JSON NAME [NAME...]``
with BATCHES_JSON ``[[max_queue, [text, ...]], ...]``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run with NUMBA_ENABLE_CUDASIM=1"
import faulthandler  # noqa: E402

# a hang in the simulator dumps every thread's stack and exits 1 (see _sim_check.py)
faulthandler.dump_traceback_later(float(os.environ.get("TOKTIER_SIM_HANG_S", "240")), exit=True)
sys.setswitchinterval(2e-4)  # simulated threads hand the GIL over faster (as in _sim_check.py)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("TOKTIER_SHARED", REPO.parent / "shared"))

from toktier_backend.engines.hf import HFEngine  # noqa: E402
from toktier_backend.gpu.engine import GpuEngine  # noqa: E402
from toktier_backend.gpu.routing import GpuRouter  # noqa: E402


class Counted:
    """The engine, counting its ``encode_batch`` calls (one per device pass the router asks for)."""

    def __init__(self, engine):
        self.engine, self.passes = engine, 0

    def accepts(self, text):
        return self.engine.accepts(text)

    def encode(self, text):
        return self.engine.encode(text)

    def encode_batch(self, texts):
        self.passes += 1
        return self.engine.encode_batch(texts)


def check(name: str, crossover: int, batches: list) -> dict:
    t0 = time.perf_counter()
    path = str(SHARED / "tokenizers" / name / "tokenizer.json")
    engine = GpuEngine(path)
    gpu, cpu = Counted(engine), HFEngine(path)
    out = []
    for max_queue, texts in batches:
        router = GpuRouter(cpu, gpu, crossover_chars=crossover, max_queue=max_queue)
        before = gpu.passes
        results = []
        for r in router.encode_many(texts):
            results.append(f"error: {type(r).__name__}: {r}" if isinstance(r, Exception) else [r[0].tolist(), r[1]])
        router.close()
        out.append({"max_queue": max_queue, "texts": texts, "results": results, "passes": gpu.passes - before})
    return {"name": name, "batches": out, "stats": engine.stats, "seconds": round(time.perf_counter() - t0, 1)}


if __name__ == "__main__":
    crossover, batches = int(sys.argv[1]), json.loads(sys.argv[2])
    print(json.dumps([check(n, crossover, batches) for n in sys.argv[3:]]))
