#!/usr/bin/env bash
# Device check for the GPU full-encode path (toktier_backend.gpu): one script, one JSON, under 8 minutes.
#
#   0. install what is missing (numba, cupy-cuda12x, nvidia-cuda-nvcc-cu12; the project itself from this
#      checkout): from wheels in .whl/ when present (the device reaches no network), else from the index
#   1. environment report (GPU, numba / numba-cuda, cupy, tokenizers versions) -> the log
#   2. python bench/gpu.py --device-check: stages, each with its own time budget (bench/gpu.py BUDGETS_S;
#      a stage at its budget is recorded as skipped with the reason, and the next one runs):
#        exactness   gpt2 / llama3_1 / qwen3 / deepseek_v3 on real text (traps, agent corpus, 1K..1M chars):
#                    single requests, one encode_batch pass, GpuRouter.encode_many with a lone surrogate in
#                    the batch; every id against HF tokenizers
#        single_1m   1M-char requests, p50/p90, direct launches and CUDA graphs (CuPy), HF beside
#        batches     8 / 32 / 128 x 100K chars through GpuRouter.encode_many (one pass each): MB/s
#        crossover   routing.measure_crossover against the tokenizer's own CPU encode
#        served      toktier_encode on tritonserver (loopback), --encode-gpu-instances 1 vs CPU only
#   The JSON is rewritten after each stage; the whole run is under `timeout` ($TOTAL_S, default 450 s),
#   and a killed run leaves its finished stages plus a "killed" note.
#
# --dry-run: the same stages end to end on numba's CUDA simulator at tiny sizes (no GPU; the served stage
# runs its CPU-only arm on a real tritonserver and records the GPU arm as skipped). JSON under $OUT
# (a temp dir when OUT is unset): gpu_device_check.json.
#
# Prepare here, once (the device does not see ../shared):
#   echo /shared/ >> .git/info/exclude; mkdir -p shared/tokenizers
#   cp -r ../shared/corpus shared/; for n in gpt2 llama3_1 qwen3 deepseek_v3; do cp -r ../shared/tokenizers/$n shared/tokenizers/; done
#   (served stage) wheels of nvidia-pytriton and tritonclient[grpc] (cp312) in .whl/, per /work/.library/device/README.md
# Run: device.run(command="bash bench/gpu_device_check.sh", timeout_s=540[, carry=[".whl"]])
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
  esac
done
OUT="${OUT:-$(mktemp -d -t toktier-gpu-check-XXXXXX)}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/gpu_device_check.log"
JSON="$OUT/gpu_device_check.json"
log() { echo "[$(date +%T)] $*" | tee -a "$LOG" >&2; }
PY="${PYTHON:-python3}"
TOTAL_S="${TOTAL_S:-$([ "$DRY" -eq 1 ] && echo 170 || echo 450)}"

log "0. install (what is missing)"
need=()
$PY -c "import numba" 2>/dev/null || need+=(numba)
if [ "$DRY" -eq 0 ]; then
  $PY -c "import cupy" 2>/dev/null || need+=(cupy-cuda12x)
  $PY -c "import nvidia.cuda_nvcc" 2>/dev/null || command -v nvcc >/dev/null || need+=(nvidia-cuda-nvcc-cu12)
fi
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tee -a "$LOG" \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  need=()
fi
if [ "${#need[@]}" -gt 0 ]; then
  $PY -m pip install -q "${need[@]}" 2>&1 | tail -3 | tee -a "$LOG" || log "pip install ${need[*]} failed: the stages report what is missing"
fi
# the project from this checkout: an editable install without dependencies where pip can build it offline
# (setuptools present), and this checkout first on PYTHONPATH either way (tritonserver's stubs inherit it)
if [ "$DRY" -eq 0 ] && ! (cd /tmp && $PY -c "import toktier_backend" 2>/dev/null); then
  $PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3 | tee -a "$LOG" || log "editable install failed; PYTHONPATH only"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d shared/tokenizers ]; then export TOKTIER_SHARED="$PWD/shared"; fi
: "${TOKTIER_SHARED:=$PWD/../shared}"
export TOKTIER_SHARED

log "1. environment"
{ nvidia-smi -L 2>&1 || echo "no nvidia-smi"; } | tee -a "$LOG" >&2
[ "$DRY" -eq 1 ] && export NUMBA_ENABLE_CUDASIM=1
$PY - <<'PY' 2>&1 | tee -a "$LOG" >&2
import importlib, os, sys
print("python", sys.version.split()[0], "TOKTIER_SHARED", os.environ.get("TOKTIER_SHARED"))
for m in ("numpy", "numba", "numba_cuda", "cupy", "tokenizers", "tritonclient", "pytriton"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "?"))
    except Exception as e:
        print(m, "MISSING", type(e).__name__, e)
PY

log "2. stages (dry run: $DRY)"
args=(bench/gpu.py --device-check --out "$JSON")
[ "$DRY" -eq 1 ] && args+=(--dry-run)
timeout --kill-after=10 "$TOTAL_S" $PY "${args[@]}" 2>&1 | tee -a "$LOG" >&2
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  log "stages killed after ${TOTAL_S} s"
  $PY - "$JSON" "$TOTAL_S" <<'PY'
import json, sys
from pathlib import Path
p = Path(sys.argv[1])
r = json.loads(p.read_text()) if p.exists() else {"kind": "gpu_device_check", "stages": {}}
r["killed"] = f"the run reached the script's overall timeout ({sys.argv[2]} s); stages missing here did not finish"
r.setdefault("exact", False)
p.write_text(json.dumps(r, indent=1))
PY
fi
log "rc=$rc; JSON: $JSON"
echo "$JSON"
exit "$rc"
