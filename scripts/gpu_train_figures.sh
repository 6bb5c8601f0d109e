#!/usr/bin/env bash
# One-GPU training figures: a GSM8K-layout multi-turn config (configs/gsm8k-multiturn.yaml,
# smaller batch) on a random-init Qwen2 (builtin-qwen2-*: 151,936-row head, the built-in
# tokenizer on its first rows) through the FSDP2 path on one rank (torchrun, a process group
# of one), the engine colocated and releasing its KV cache while the actor trains. Prints
# per step: time and shares (rollout / train / sync), training tokens/s and TFLOP/s (MFU
# against PEAK_TFLOPS), weight-sync seconds, peak memory, release/resume seconds.
#
#   PYTHONPATH=/tmp/new:/tmp/base:src OUT=/path bash scripts/gpu_train_figures.sh
#
# Needs data/gsm8k (tailcut data gsm8k). Knobs: PY, SIZES ("1.5b"), STEPS (3), BATCH (32
# prompts), GROUP (8), NEW_TOKENS (256 a turn), RESPONSE (512 a trajectory), RELEASE (kv),
# PEAK_TFLOPS (790, the bf16 figure the issue states), LIMIT_S (300 per run), MODEL (instead
# of builtin-qwen2-SIZE), EXTRA (more overrides). CPU dry run: SIZES=cpu MODEL=builtin \
#   EXTRA="engine.device=cpu actor.device=cpu engine.dtype=float32 actor.dtype=float32" \
#   STEPS=1 BATCH=2 GROUP=2 NEW_TOKENS=8 RESPONSE=16 PY=.venv/bin/python PYTHONPATH=src \
#   bash scripts/gpu_train_figures.sh
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_train}"
mkdir -p "$OUT"
PY="${PY:-python3}"
export PYTHONPATH="${PYTHONPATH:-/tmp/new:/tmp/base:src}"
export TAILCUT_CACHE="${TAILCUT_CACHE:-/tmp/tailcut-cache}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
for size in ${SIZES:-1.5b}; do
    run="$OUT/train-$size"
    rm -rf "$run"
    timeout "${LIMIT_S:-300}" "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
        -m tailcut train configs/gsm8k-multiturn.yaml \
        "engine.model=${MODEL:-builtin-qwen2-$size}" "trainer.run_dir=$run" \
        "trainer.steps=${STEPS:-3}" trainer.val_every=0 data.val_size=0 trainer.save_every=0 \
        trainer.checkpoint_format=sharded "trainer.loggers=[console,jsonl]" \
        "data.batch_size=${BATCH:-32}" "algo.group_size=${GROUP:-8}" cutoff.audit_every=0 \
        agent.max_turns=2 "agent.max_new_tokens=${NEW_TOKENS:-256}" \
        "agent.max_response_tokens=${RESPONSE:-512}" data.max_prompt_tokens=512 \
        engine.hf.max_seq_len=1280 engine.max_batch_size=256 algo.kl_coef=0 \
        actor.max_tokens_per_micro_batch=32768 actor.micro_batch_rows=64 \
        "engine.release_between_steps=${RELEASE:-kv}" ${EXTRA:-} \
        > "$run.out" 2> "$run.log"
    echo "train-$size rc=$?" | tee -a "$OUT/train_steps.txt"
done
"$PY" - "$OUT" "${PEAK_TFLOPS:-790}" <<'PYEOF' | tee "$OUT/train_summary.txt"
import json, pathlib, sys

out, peak = pathlib.Path(sys.argv[1]), float(sys.argv[2])
for run in sorted(out.glob("train-*/metrics.jsonl")):
    rows = [json.loads(l) for l in run.read_text().splitlines() if l.strip()]
    print(f"{run.parent.name}: {len(rows)} steps")
    for r in rows:
        g = lambda k, d=0.0: r.get(k, d)
        tf = g("perf/train_tflops_per_s")
        print(f"  step {r['step']}: {g('timing/step_s'):.1f} s = rollout {g('timing/rollout_s'):.1f}"
              f" ({g('timing/share_rollout'):.0%}) + train {g('timing/train_s'):.1f}"
              f" ({g('timing/share_train'):.0%}) + sync {g('timing/sync_s'):.2f}"
              f" | {g('rollout/launched'):.0f} launched, {g('batch/real_rows'):.0f} trained,"
              f" {g('rollout/generated_tokens'):,.0f} tokens generated"
              f" | train {g('perf/train_tokens'):,.0f} tok, {g('perf/train_tokens_per_s'):,.0f} tok/s,"
              f" {tf:.0f} TFLOP/s = MFU {tf / peak:.1%} of {peak:.0f}"
              f" | peak mem {g('memory/peak_allocated_bytes') / 1e9:.1f} GB"
              f" | release {g('memory/release_s', -1):.3f} s (freed {g('memory/device_freed_bytes') / 1e9:.1f} GB),"
              f" resume {g('memory/resume_s', -1):.3f} s")
PYEOF
