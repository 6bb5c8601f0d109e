#!/usr/bin/env bash
# The cut's saving end to end on one GPU: the embedded engine on a random-init Qwen2 (the
# 151,936-row head, the built-in tokenizer on its first rows) plays the seed-gsm8k workload
# (`tailcut rollout --workload`: each trajectory's turns, sampled-token counts, tool
# latencies and tool answers as the workload draws them — the reference's long tail), one
# step of REQUESTS requests in groups of GROUP, under wait-all and the cut policies, same
# trajectories and seeds. Beside each measured ratio of kept samples/s to wait-all's: the
# replay of the measured wait-all step under that policy (`tailcut replay`: the simulated
# engine fitted to this engine's own trace) and the simulated engine with its default cost
# model (`tailcut bench --engine sim`, the same workload, requests and running limit).
#
#   PYTHONPATH=/tmp/new:/tmp/base:src OUT=/path bash scripts/gpu_cut_figures.sh
#
# Knobs: PY, SIZE (1.5b), MODEL (instead of builtin-qwen2-SIZE), REQUESTS (512), GROUP (8),
# SLOTS (256: sequences decoded together), POLICIES, KEEP (0.9: the kept fraction F;
# target-count aborts 1-F, over-provision and group-quota launch 1/F-1 more), LIMIT_S (180
# a run). CPU dry run: MODEL=builtin DEVICE=cpu REQUESTS=8 GROUP=4 SLOTS=16 \
#   PY=.venv/bin/python PYTHONPATH=src bash scripts/gpu_cut_figures.sh
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_cut}"
mkdir -p "$OUT"
PY="${PY:-python3}"
export PYTHONPATH="${PYTHONPATH:-/tmp/new:/tmp/base:src}"
export TAILCUT_CACHE="${TAILCUT_CACHE:-/tmp/tailcut-cache}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODEL="${MODEL:-builtin-qwen2-${SIZE:-1.5b}}"
REQUESTS="${REQUESTS:-512}"
GROUP="${GROUP:-8}"
SLOTS="${SLOTS:-256}"
KEEP="${KEEP:-0.9}"
POLICIES="${POLICIES:-wait-all target-count over-provision group-quota}"
TRACES="$OUT/traces"
over=$("$PY" -c "print(1 / $KEEP - 1)")
abort=$("$PY" -c "print(1 - $KEEP)")
: > "$OUT/cut_steps.txt"
for p in $POLICIES; do
    start=$(date +%s)
    timeout "${LIMIT_S:-180}" "$PY" -m tailcut rollout --workload seed-gsm8k --engine hf \
        --model "$MODEL" --device "${DEVICE:-cuda}" --requests "$REQUESTS" --group-size "$GROUP" \
        --policy "$p" --abort-ratio "$abort" --over-provision "$over" \
        --max-batch-size "$SLOTS" --seed 0 --trace-dir "$TRACES/$p" --json \
        > "$OUT/cut_$p.json" 2> "$OUT/cut_$p.log"
    echo "$p rc=$? $(($(date +%s) - start))s" | tee -a "$OUT/cut_steps.txt"
done
policy_args=()
for p in $POLICIES; do policy_args+=(--policy "$p"); done
"$PY" -m tailcut replay "$TRACES/wait-all" "${policy_args[@]}" --target-fraction "$KEEP" \
    --group-size "$GROUP" --json > "$OUT/replay.json" 2> "$OUT/replay.log"
echo "replay rc=$?" | tee -a "$OUT/cut_steps.txt"
"$PY" -m tailcut bench --engine sim --workload seed-gsm8k --requests "$REQUESTS" \
    --group-size "$GROUP" --target-fraction "$KEEP" --max-running "$SLOTS" "${policy_args[@]}" \
    --no-overhead --scale-cut 0 --json > "$OUT/sim.json" 2> "$OUT/sim.log"
echo "sim rc=$?" | tee -a "$OUT/cut_steps.txt"

"$PY" - "$OUT" $POLICIES <<'PYEOF' | tee "$OUT/cut_summary.txt"
import json, pathlib, sys

out, policies = pathlib.Path(sys.argv[1]), sys.argv[2:]


def load(name):
    try:
        return json.loads((out / name).read_text())
    except Exception as exc:
        print(f"{name}: unreadable ({exc})")
        return None


def per_s(rows):  # policy -> kept samples/s from a bench or replay payload
    return {r["policy"]: r["samples_per_s"] for r in rows}


real = {p: load(f"cut_{p}.json") for p in policies}
replay, sim = load("replay.json"), load("sim.json")
rep = per_s(replay["bench"]["rows"]) if replay else {}
simr = per_s(sim["rows"]) if sim else {}
base = real.get("wait-all")
base_rate = base["kept"] / base["step_time_s"] if base else None
print(f"{'policy':<15} {'launched':>8} {'kept':>5} {'aborted':>7} {'step s':>7} {'cut s':>7} "
      f"{'idle s':>7} {'kept/s':>7} {'ratio':>6} {'replay':>6} {'sim':>6}  wasted tok")
for p, r in real.items():
    if not r:
        continue
    rate = r["kept"] / r["step_time_s"]
    ratio = rate / base_rate if base_rate else float("nan")
    rr = rep.get(p, 0) / rep["wait-all"] if rep.get("wait-all") else float("nan")
    sr = simr.get(p, 0) / simr["wait-all"] if simr.get("wait-all") else float("nan")
    print(f"{p:<15} {r['launched']:>8} {r['kept']:>5} {r['aborted']:>7} {r['step_time_s']:>7.1f} "
          f"{r['cut_time_s'] or 0:>7.1f} {r['abort_to_idle_s'] or 0:>7.3f} {rate:>7.2f} {ratio:>6.2f} "
          f"{rr:>6.2f} {sr:>6.2f}  {r['wasted_tokens']:,} of {r['generated_tokens']:,}")
print(open(out / "cut_steps.txt").read().strip())
PYEOF
