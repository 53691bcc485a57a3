#!/usr/bin/env bash
# Device check for the GPU full-encode path (toktier_backend.gpu): one prepared script, ~6-8 min.
#
#   1. environment report (GPU, numba / numba-cuda, cupy, tokenizers versions)
#   2. smoke: GpuEngine(gpt2).encode("hello world") == [31373, 995] (includes the kernels' JIT compile)
#   3. exactness on the device: pytest -m gpu tests/gpu/test_device.py (agent corpus, batches, 1M chars,
#      200K-space / 100K-'=' / 300K-'a' runs through the block kernel, CUDA graph vs direct launches)
#   4. bench/gpu.py: exact first, then 10K/100K/1M-char single requests (CUDA events, with and without
#      graphs), a 64 x 16K batch, 1M-char runs, per-stage device ms, crossover vs the CPU engine
#
# Prepare here, once (the device reaches no network and does not see ../shared):
#   echo /shared/ >> .git/info/exclude; mkdir -p shared/tokenizers
#   cp -r ../shared/corpus shared/; for n in gpt2 llama3_1 qwen3 deepseek_v3; do cp -r ../shared/tokenizers/$n shared/tokenizers/; done
#   (optional, for the gigatoken CPU column; else the HF reference is the CPU engine) a cp312 gigatoken wheel in
#   .whl/ as /work/.library/device/README.md says, then pass carry=[".whl"].
# Run: device.run(command="bash bench/gpu_device_check.sh", timeout_s=540[, carry=[".whl"]])
# Results come back under $OUT: gpu_device_check.log, gpu_tests.log, gpu_bench.log, gpu.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/gpu_device_check.log"
log() { echo "[$(date +%T)] $*" | tee -a "$LOG"; }
PY="${PYTHON:-python3}"

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d shared/tokenizers ]; then export TOKTIER_SHARED="$PWD/shared"; fi
: "${TOKTIER_SHARED:=$PWD/../shared}"
export TOKTIER_SHARED

log "1. environment"
nvidia-smi -L 2>&1 | tee -a "$LOG"
$PY - <<'PY' 2>&1 | tee -a "$LOG"
import importlib, os, sys
print("python", sys.version.split()[0], "TOKTIER_SHARED", os.environ.get("TOKTIER_SHARED"),
      "exists", os.path.isdir(os.path.join(os.environ.get("TOKTIER_SHARED", ""), "tokenizers")))
for m in ("numpy", "numba", "numba_cuda", "llvmlite", "cupy", "tokenizers", "gigatoken", "pytest", "hypothesis"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "?"))
    except Exception as e:
        print(m, "MISSING", type(e).__name__, e)
from numba import cuda
print("cuda.is_available", cuda.is_available())
if cuda.is_available():
    d = cuda.get_current_device(); print("device", d.name, "cc", d.compute_capability)
PY

log "2. smoke (JIT compile + hello world)"
timeout 240 $PY -c "
import time; t=time.time()
from toktier_backend.gpu import GpuEngine
e = GpuEngine('toktier_backend/data/gpt2/tokenizer.json')
ids = e.encode('hello world').tolist(); print('hello world ->', ids, 'in %.1f s (first call: compile)' % (time.time()-t))
assert ids == [31373, 995], ids
" 2>&1 | tee -a "$LOG"
smoke=${PIPESTATUS[0]}
[ "$smoke" -eq 0 ] || { log "smoke FAILED (rc=$smoke): stopping"; exit "$smoke"; }

log "3. exactness tests (-m gpu)"
timeout 240 $PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_device.py -rs 2>&1 | tee "$OUT/gpu_tests.log"
tests=${PIPESTATUS[0]}
log "tests rc=$tests"

log "4. bench/gpu.py"
names=$(for n in gpt2 llama3_1 qwen3 deepseek_v3; do [ -f "$TOKTIER_SHARED/tokenizers/$n/tokenizer.json" ] && printf '%s,' "$n"; done)
timeout 270 $PY bench/gpu.py --tokenizers "${names%,}" --sizes 10000,100000,1000000 --repeats 5 --stages \
  --out "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu_bench.log"
bench=${PIPESTATUS[0]}
log "bench rc=$bench"
exit $(( tests != 0 ? tests : bench ))
