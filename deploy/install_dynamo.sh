#!/usr/bin/env bash
# Install ai-dynamo 1.6.1 (frontend, mocker, runtime) into the active Python environment, from PyPI only.
#
# On a machine that reaches the usual index, `pip install ai-dynamo==1.6.1` is all it takes. With PyPI
# only, that fails: ai-dynamo 1.6.1 requires aisimulate==0.13.0, which pip cannot get from PyPI (it
# resolves to another index, unreachable here). aisimulate is imported only by Dynamo's planner / profiler /
# simulation code, never by `dynamo.frontend`, `dynamo.mocker` or the runtime, so this installs the runtime
# wheel, then ai-dynamo without its dependencies, then the rest of its requirements by hand (the list read from the 1.6.1 wheel's metadata, aisimulate left out).
#
# Usage: . .venv/bin/activate && deploy/install_dynamo.sh      (idempotent; 25-30 s here with a warm pip cache)
set -euo pipefail
VERSION="${DYNAMO_VERSION:-1.6.1}"
PY="${PYTHON:-python}"
if "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('ai-dynamo') == '$VERSION' and m.version('ai-dynamo-runtime') == '$VERSION' else 1)" 2>/dev/null; then
  echo "install_dynamo: ai-dynamo $VERSION already installed"
  exit 0
fi
"$PY" -m pip install -q "ai-dynamo-runtime==$VERSION"
"$PY" -m pip install -q --no-deps "ai-dynamo==$VERSION"
REQS_FILE=$(mktemp)
trap 'rm -f "$REQS_FILE"' EXIT
"$PY" - "$REQS_FILE" <<'PY'
import importlib.metadata as m, re, sys
out = []
for r in m.requires("ai-dynamo") or ():
    if ";" in r and "extra" in r.split(";", 1)[1]:
        continue  # optional extras (vllm, sglang, trtllm, ...)
    name = re.split(r"[ ;<>=!~\[]", r, 1)[0].lower().replace("_", "-")
    if name in ("aisimulate", "ai-dynamo-runtime"):
        continue  # aisimulate: not installable from PyPI here, not imported by the frontend/mocker; runtime: installed above
    out.append(r.split(";", 1)[0].strip())

open(sys.argv[1], "w").write("\n".join(out) + "\n")
PY
echo "install_dynamo: requirements of ai-dynamo $VERSION (aisimulate left out):" $(cat "$REQS_FILE")
"$PY" -m pip install -q -r "$REQS_FILE"
"$PY" -m dynamo.frontend --version
