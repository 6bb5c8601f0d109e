"""Worker process for :mod:`tailcut.reward.math`: math-verify on its own main thread.

math-verify bounds its parsing and comparison with ``SIGALRM``, which only works on a
process's main thread; here it is the only thread. Protocol: one JSON object per line.
The worker prints ``{"ready": true}`` once its imports are done, then answers each
``{"id", "gold", "pred", "timeout_s"}`` with ``{"id", "correct", "pred", "error"}``.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

SHOWN_CHARS = 1000
"""The parsed answer a reply echoes (for metrics and logs), cut to this length."""


def _gold_text(gold: str) -> str:
    """The ground truth as math-verify reads it: boxed, unless it is boxed or delimited by
    ``$`` already (an escaped ``\\$``, a currency sign, is no delimiter)."""
    text = gold.strip()
    if "\\boxed" in text or re.search(r"(?<!\\)\$", text):
        return text
    return "\\boxed{" + text + "}"


def verify_one(gold: str, pred: str, timeout_s: int) -> dict[str, Any]:
    from math_verify import parse, verify

    gold_parsed = parse(_gold_text(gold), parsing_timeout=timeout_s)
    if not gold_parsed:
        return {"correct": False, "pred": None, "error": f"cannot parse ground truth {gold!r}"}
    pred_parsed = parse(pred, parsing_timeout=timeout_s)
    shown = str(pred_parsed[-1])[:SHOWN_CHARS] if pred_parsed else None
    correct = bool(pred_parsed) and verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s)
    return {"correct": bool(correct), "pred": shown, "error": None}


def main() -> None:
    import math_verify  # noqa: F401  (pay the import before saying ready)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = verify_one(request["gold"], request["pred"], int(request["timeout_s"]))
        except Exception as exc:  # reported to the caller, which decides
            reply = {"correct": False, "pred": None, "error": f"{type(exc).__name__}: {exc}"}
        reply["id"] = request["id"]
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
