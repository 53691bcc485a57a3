"""Load ``toktier_encode``'s model.py as a Triton GPU instance would, on numba's CUDA simulator, and encode.

Run as a script (``tests/gpu/test_router_wiring.py`` starts it in a subprocess with
``NUMBA_ENABLE_CUDASIM=1``). Prints one JSON object: ``{"name", "gpu_status", "gpu_reason", "replies":
[[text, flag, ids or error], ...], "routes": {route: count}, "loads": {result: count}, "router_counts"}``.
Expected ids are computed by the test, not here.

Usage: ``NUMBA_ENABLE_CUDASIM=1 python tests/gpu/_wiring_check.py NAME CROSSOVER TEXTS_JSON``.

The canary is cut to its first text here: the simulator runs every CUDA thread as a Python thread, and
the full canary (10 texts plus every added token: llama3_1's is 31 KB) would take minutes. The GPU
engine's kernels are checked against HF on the simulator in ``test_simulator.py``; what this script checks
is the wiring, with the canary call in it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run with NUMBA_ENABLE_CUDASIM=1"
import faulthandler  # noqa: E402

# a hang in the simulator dumps every thread's stack and exits 1 (see _sim_check.py)
faulthandler.dump_traceback_later(float(os.environ.get("TOKTIER_SIM_HANG_S", "240")), exit=True)
sys.setswitchinterval(2e-4)  # simulated threads hand the GIL over faster (as in _sim_check.py)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("TOKTIER_SHARED", REPO.parent / "shared"))

from prometheus_client import REGISTRY  # noqa: E402

from toktier_backend.engines import admission  # noqa: E402
from tests.serving.fake_pb_utils import encode_request, load_model  # noqa: E402

_full_canary = admission.canary_texts
admission.canary_texts = lambda spec: _full_canary(spec)[:1]  # see the module docstring


def samples(name: str, model: str = "toktier_encode") -> dict[str, float]:
    out = {}
    for fam in REGISTRY.collect():
        for s in fam.samples:
            if s.name == name and s.labels.get("model") == model:
                out[s.labels.get("route") or s.labels.get("result")] = s.value
    return out


def main(name: str, crossover: int, texts: list[list]) -> dict:
    path = SHARED / "tokenizers" / name / "tokenizer.json"
    state = tempfile.mkdtemp(prefix="toktier-wiring-")
    model = load_model("toktier_encode", kind="GPU", device_id=0, parameters={
        "tokenizer": str(path), "gpu_engine": "auto", "gpu_crossover_chars": str(crossover),
        "verifier_rate": "0", "verifier_first_n": "0", "quarantine_file": os.path.join(state, "q.json"),
        "pool_workers": "1", "pool_express": "0", "pool_nice": "0",
    })
    router = model.handler.router
    requests = [encode_request(text, flag) for text, flag in texts]
    replies = []
    for (text, flag), resp in zip(texts, model.execute(requests)):  # one batch, as the dynamic batcher sends
        if resp.has_error():
            replies.append([text, flag, f"error: {resp.error.message()}"])
        else:
            replies.append([text, flag, resp.output("INPUT_ID").reshape(-1).tolist()])
    model.finalize()
    return {"name": name, "gpu_status": router.gpu_status, "gpu_reason": router.gpu_reason, "replies": replies,
            "routes": samples("toktier_encode_route_total"), "loads": samples("toktier_gpu_engine_loads_total"),
            "router_counts": dict(router.counts)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]))))
