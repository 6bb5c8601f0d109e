#!/usr/bin/env bash
# Issue 16's figures on one GPU, in one go (~6 min on an H200): the embedded engine at
# batch 64/256/1024 on random-init Qwen2-0.5B and -1.5B (151,936-row head, the built-in
# tokenizer on its first rows), tokens/s beside the weight-read bound, decode and prefill
# ms/pass, peak memory, release/resume of the KV cache and weights; the full-vocabulary
# sampling cost; eager decode against CUDA graphs; the attention projections by cuBLAS and
# by the skinny kernel (engine.hf.skinny_linear); the engine against model.generate; the
# opt-in GPU tests; last, a switch not yet decided (engine.hf.pdl) against the defaults,
# alternated. Every step is time-boxed and logged; a failed step does not stop the others.
# JSON lands in $OUT/, a compact summary on stdout and in $OUT/summary.txt.
#
#   PYTHONPATH=/tmp/new:/tmp/base:src OUT=/path bash scripts/gpu_figures.sh
#
# Knobs (environment): PY (python3), DEVICE (cuda), SIZES ("0.5b 1.5b": builtin-qwen2-*
# models built first), MODELS (more specs to sweep, e.g. random-tiny or a model directory),
# BATCHES ("64 256 1024"), NEW_TOKENS (128), HBM_GBS (4800), UNCOMPILED (1: each size
# again without engine.hf.compile_layers), RUN_EXTRAS (1), RUN_TESTS (1), RUN_AB (1),
# AB_ARGS ("--switch pdl": what B sets, hf_ab's options), AB_ROUNDS (2),
# TAILCUT_CACHE (/tmp/tailcut-cache: where the models are built, offline), DEADLINE_S (570:
# the whole script ends by then, skipping or cutting what would run past it, so that a
# 10-minute limit on the command still leaves the summary).
# CPU dry run (a minute): DEVICE=cpu SIZES= MODELS=random-tiny BATCHES="2 4" NEW_TOKENS=4 \
#   RUN_TESTS=0 AB_ARGS="--switch no-fuse" PYTHONPATH=src bash scripts/gpu_figures.sh
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_figures}"
mkdir -p "$OUT"
PY="${PY:-python3}"
export PYTHONPATH="${PYTHONPATH:-/tmp/new:/tmp/base:src}"
export TAILCUT_CACHE="${TAILCUT_CACHE:-/tmp/tailcut-cache}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
DEVICE="${DEVICE:-cuda}"
SIZES="${SIZES-0.5b 1.5b}"
MODELS="${MODELS:-}"
BATCHES="${BATCHES:-64 256 1024}"
NEW_TOKENS="${NEW_TOKENS:-128}"
HBM_GBS="${HBM_GBS:-4800}"
DEADLINE_S="${DEADLINE_S:-570}"
T0=$(date +%s)
: > "$OUT/steps.txt"

step() {  # step NAME LIMIT_S CMD... : stdout to $OUT/NAME.out, stderr to $OUT/NAME.log
    local name=$1 limit=$2 start rc left
    shift 2
    start=$(date +%s)
    left=$((DEADLINE_S - (start - T0) - 15))
    if [ "$left" -lt 20 ]; then
        echo "$name skipped (deadline)" | tee -a "$OUT/steps.txt"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.log"
    rc=$?
    echo "$name rc=$rc $(($(date +%s) - start))s (limit ${limit}s)" | tee -a "$OUT/steps.txt"
}

step env 60 "$PY" -c '
import json, platform, torch, transformers
d = {"python": platform.python_version(), "torch": torch.__version__,
     "transformers": transformers.__version__, "cuda": torch.cuda.is_available()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    d.update(gpu=p.name, gpu_memory_bytes=p.total_memory)
print(json.dumps(d))'
cp "$OUT/env.out" "$OUT/env.json" 2>/dev/null
cat "$OUT/env.json" 2>/dev/null

resolve() {  # a builtin-* spec -> its built directory (anything else as it is)
    case "$1" in
        builtin*) "$PY" -c "from tailcut.models.resolve import resolve_model; print(resolve_model('$1'))" ;;
        *) echo "$1" ;;
    esac
}

sweep() {  # sweep NAME LIMIT_S MODEL ARGS...
    local name=$1 limit=$2 model=$3 dir
    shift 3
    dir=$(resolve "$model") || { echo "$name: cannot resolve $model" | tee -a "$OUT/steps.txt"; return; }
    step "$name" "$limit" "$PY" -m tailcut.bench.hf_sweep "$dir" --name "$model" \
        --device "$DEVICE" --max-new-tokens "$NEW_TOKENS" --hbm-gbs "$HBM_GBS" \
        --out "$OUT/$name.json" "$@"
}

specs=""
for s in $SIZES; do  # build offline (cached in $TAILCUT_CACHE), then the sweep
    step "build_$s" 240 "$PY" -c "
import json
from tailcut.models.build import VARIANTS, ensure_built
r = ensure_built(VARIANTS['qwen2-$s'])
print(json.dumps({'path': str(r.path), 'cached': r.cached,
                  **{k: v for k, v in r.info.items() if k not in ('files', 'recipe')}}))"
    cp "$OUT/build_$s.out" "$OUT/build_$s.json" 2>/dev/null
    # shellcheck disable=SC2086
    sweep "sweep_$s" 240 "builtin-qwen2-$s" --batch $BATCHES
    if [ "${UNCOMPILED:-1}" = 1 ]; then  # the same without engine.hf.compile_layers
        # shellcheck disable=SC2086
        sweep "uncompiled_$s" 240 "builtin-qwen2-$s" --batch $BATCHES --no-compile
    fi
    specs="$specs builtin-qwen2-$s"
done
for m in $MODELS; do
    tag=$(basename "$m")
    # shellcheck disable=SC2086
    sweep "sweep_$tag" 300 "$m" --batch $BATCHES
    specs="$specs $m"
done

read -r first _ <<< "$specs"
tag=$(basename "${first:-none}")
last_batch=${BATCHES##* }
if [ "${RUN_EXTRAS:-1}" = 1 ] && [ -n "${first:-}" ]; then
    # sampling over every row of the head (a checkpoint whose tokenizer fills it)
    sweep "fullvocab_$tag" 120 "$first" --batch "$last_batch" --full-vocab --no-release
    # eager decode at the smallest batch: what the CUDA graphs buy (profiled: per kernel)
    sweep "eager_$tag" 90 "$first" --batch "${BATCHES%% *}" --no-graphs --no-release --profile
    # where a replayed decode pass's time goes: device busy time beside the wall time
    sweep "profile_$tag" 90 "$first" --batch "${BATCHES%% *}" --no-release --profile
    # the attention projections: cuBLAS against engine.hf.skinny_linear's kernel, alone
    # and in the pass (the same sweep as sweep_* at the smallest batch, the kernel on)
    if [ "$DEVICE" = cuda ] && [ -f "$(resolve "$first")/config.json" ]; then
        step "linear_bench_$tag" 60 "$PY" -m tailcut.bench.linear_bench "$(resolve "$first")"
        sweep "skinny_$tag" 120 "$first" --batch "${BATCHES%% *}" --no-release --skinny-linear
    fi
    # the engine against batched model.generate (same prompts and lengths), aborts
    step "vs_generate_$tag" 120 "$PY" -m tailcut bench --engine hf --model "$first" \
        --device "$DEVICE" --requests 128 --concurrency 64 --max-new-tokens "$NEW_TOKENS" --json
    cp "$OUT/vs_generate_$tag.out" "$OUT/vs_generate_$tag.json" 2>/dev/null
fi

if [ "${RUN_TESTS:-1}" = 1 ]; then
    step gpu_tests 150 "$PY" -m pytest -q -m gpu tests/gpu -o addopts="" -p no:cacheprovider
    tail -n 3 "$OUT/gpu_tests.out"
fi

# switches not yet decided, each against the defaults at the smallest batch, alternated
# A B, B A on this machine (python -m tailcut.bench.hf_ab): programmatic dependent launch
# (engine.hf.pdl, Hopper); AB_ARGS replaces what B sets
# (off CUDA only with AB_ARGS: engine.hf.pdl is refused there)
if [ "${RUN_AB:-1}" = 1 ] && [ -n "${first:-}" ] && { [ "$DEVICE" = cuda ] || [ -n "${AB_ARGS:-}" ]; }; then
    if dir=$(resolve "$first"); then
        # shellcheck disable=SC2086
        step "ab_$tag" 420 "$PY" -m tailcut.bench.hf_ab "$dir" ${AB_ARGS:---switch pdl} \
            --rounds "${AB_ROUNDS:-2}" --batch "${BATCHES%% *}" --max-new-tokens "$NEW_TOKENS" \
            --device "$DEVICE" --hbm-gbs "$HBM_GBS" --timeout-s 100 --out "$OUT/ab_$tag"
        tail -n 12 "$OUT/ab_$tag.out"
    else
        echo "ab_$tag: cannot resolve $first" | tee -a "$OUT/steps.txt"
    fi
fi

"$PY" - "$OUT" <<'PYEOF' | tee "$OUT/summary.txt"
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])
gb = lambda n: "-" if n is None or n < 0 else f"{n / 1e9:.2f} GB"
for f in sorted(out.glob("build_*.json")):
    try:
        b = json.loads(f.read_text())
        print(f"{f.stem}: {b['parameters'] / 1e9:.2f}B params, {b['vocab_size']:,} rows "
              f"({b['tokenizer_rows']} sampled), built in {b['build_seconds']} s, cached {b['cached']}")
    except Exception as exc:
        print(f"{f.stem}: unreadable ({exc})")
for f in sorted(out.glob("*.json")):
    if f.stem.startswith(("build_", "env", "vs_generate")):
        continue
    try:
        d = json.loads(f.read_text())
    except Exception as exc:
        print(f"{f.stem}: unreadable ({exc})")
        continue
    print(f"{f.stem}: {d['model']} {d['params'] / 1e9:.2f}B {d['dtype']} on {d['device']}, "
          f"weights {gb(d['weight_bytes'])}, bound at {d['hbm_gbs']:.0f} GB/s")
    for b in d["batches"]:
        r = b.get("release") or {}
        line = (f"  B={b['batch']:>4} (mean {b['mean_batch']:.0f}): "
                f"{b['decode_tokens_per_s'] or 0:>9,.0f} tok/s decode = {b['of_bound'] or 0:6.1%} of "
                f"{b['bound_tokens_per_s']:,.0f} | {b['decode_ms_per_pass']:.2f} ms/pass (median of "
                f"{len(b['decode_ms_per_pass_runs'])}, spread {b['decode_spread']:.1%}; bound "
                f"{b['bound_ms_per_pass']:.3f}) | prefill {b['prefill_ms_per_pass']:.1f} ms/pass | "
                f"e2e {b['tokens_per_s']:,.0f} tok/s | peak {gb(b['peak_allocated_bytes'])} "
                f"(KV {gb(b['kv_cache_bytes'])}) | sampled rows {b['vocab_rows']:,}")
        p = b.get("profile")
        if p:
            if p.get("launch_floor_ms_per_pass") is not None:
                line += (f"\n          {p['kernels_per_pass']:.0f} kernels a pass, launch floor "
                         f"{p['launch_floor_us_per_kernel']:.2f} us each = {p['launch_floor_ms_per_pass']:.2f} ms a pass")
            line += (f"\n          profiled: device busy {p['device_busy_ms_per_pass']:.2f} ms of "
                     f"{p['wall_ms_per_pass']:.2f} ms a pass; top kernels: "
                     + "; ".join(f"{k['name'][:60]} {k['ms']:.1f} ms/{k['calls']}" for k in p["kernels"][:6]))
        if r:
            freed = r["allocated_before_release"] - r["allocated_after_release"]
            line += (f"\n          release {r['release_s']:.3f} s (KV {gb(r['kv_cache_bytes_freed'])} + "
                     f"weights {gb(r['weight_bytes_offloaded'])}; allocated {gb(r['allocated_before_release'])}"
                     f" -> {gb(r['allocated_after_release'])}, freed {gb(freed) if freed > 0 else '-'}), "
                     f"resume {r['resume_s']:.3f} s, greedy equal after resume: {r['greedy_equal_after_resume']}")
        print(line)
for f in sorted(out.glob("vs_generate_*.json")):
    try:
        d = json.loads(f.read_text())
        print(f"{f.stem}: engine {d['engine']['tokens_per_s']:,.0f} tok/s vs generate "
              f"{d['generate']['tokens_per_s']:,.0f} ({d['ratio']:.1f}x) at {d['concurrency']}; abort "
              f"{d['abort']['median_ms']:.1f} ms, tokens after abort {d['abort']['tokens_after_abort']}")
    except Exception as exc:
        print(f"{f.stem}: unreadable ({exc})")
for f in sorted(out.glob("ab_*/ab.json")):
    try:
        d = json.loads(f.read_text())
        for r in d["batches"]:
            print(f"{f.parent.name}: B = {' '.join(d['switches'] + d['inductor'])} at B={r['batch']}: "
                  f"A {' '.join(f'{x:.3f}' for x in r['a_ms'])} ms, B {' '.join(f'{x:.3f}' for x in r['b_ms'])} "
                  f"ms ({' '.join(d['order'])}); A/B {r['a_over_b']:.3f}, A's spread {r['a_spread']:.1%}")
    except Exception as exc:
        print(f"{f.parent.name}: unreadable ({exc})")
print(open(out / "steps.txt").read().strip())
PYEOF
