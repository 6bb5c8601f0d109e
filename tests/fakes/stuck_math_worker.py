"""A math-verify worker that says ready, then never answers (for timeout tests)."""

import json
import sys
import time

print(json.dumps({"ready": True}), flush=True)
for _line in sys.stdin:
    time.sleep(3600)
