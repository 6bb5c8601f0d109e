#!/usr/bin/env bash
# The embedded engine's and the chat template's tests at the LOWEST transformers that
# pyproject.toml declares (`make test` runs them at the highest, which .venv resolves to).
#
# A small separate environment: that transformers and a huggingface-hub it accepts (5.x
# before 5.2x needs huggingface-hub>=1.5,<2; .venv holds 2.x), installed with `pip --target`
# into .venv/lowest/transformers-VERSION and put first on PYTHONPATH; every other package
# comes from .venv. Idempotent (the target is kept); each pytest run is bounded by
# LOWEST_TIMEOUT_S (600 s; the whole step takes about 3 minutes on 2 cores).
#
#   bash scripts/lowest_transformers.sh          # make test-lowest; .ci/run runs it
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
HUB="${LOWEST_HUB:-huggingface-hub==1.33.0}"
LOWEST=$("$PY" - <<'PY'
import re
import tomllib

with open("pyproject.toml", "rb") as fh:
    extras = tomllib.load(fh)["project"]["optional-dependencies"]
spec = next(d for deps in extras.values() for d in deps if re.match(r"transformers\b", d))
print(re.search(r">=\s*([0-9][0-9.]*)", spec).group(1))
PY
)
DIR=".venv/lowest/transformers-$LOWEST"
if [[ ! -f "$DIR/.installed" ]]; then
  rm -rf "$DIR"
  echo "installing transformers==$LOWEST and $HUB into $DIR"
  "$PY" -m pip install --quiet --no-deps --no-compile --target "$DIR" "transformers==$LOWEST" "$HUB" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)  # local index noise
  touch "$DIR/.installed"
fi
export PYTHONPATH="$PWD/$DIR"
"$PY" - "$LOWEST" <<'PY'
import sys

import huggingface_hub
import transformers
from packaging.version import Version

assert Version(transformers.__version__) == Version(sys.argv[1]), transformers.__file__
print(f"transformers {transformers.__version__}, huggingface-hub {huggingface_hub.__version__}")
PY
start=$SECONDS
pytest() { timeout "${LOWEST_TIMEOUT_S:-600}" "$PY" -m pytest -q -p no:cacheprovider "$@"; }
pytest tests/unit/test_hf_engine.py tests/unit/test_hf_batching.py tests/unit/test_hf_families.py \
  tests/unit/test_hf_fused.py tests/unit/test_hf_compiled.py \
  tests/unit/test_chat_template.py tests/unit/test_chat_tokenize.py \
  tests/unit/test_chat_families.py tests/unit/test_tool_formats.py \
  tests/integration/test_train_families.py
pytest tests/contract -k "hf-tiny"
echo "lowest transformers ($LOWEST): engine and chat-template tests passed in $((SECONDS - start)) s"
