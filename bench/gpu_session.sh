#!/usr/bin/env bash
# The open GPU measurements of #24, one step per device call (a call may run 10 minutes),
# on a lent GPU machine that has python3 and a CUDA torch but no diffusers/peft/pydantic
# and no package index. Run from the repo root there, with the wheels in .whl/
# (git-ignored) carried along:
#
#   # here, once: python 3.12 manylinux wheels of diffusers, peft and pydantic (with its
#   # three small dependencies) at the versions in .ci/constraints.txt, into .whl/
#   make gpu-wheels
#   # there, through the device tool (carry: .whl):
#   bash bench/gpu_session.sh dits        # then: sd15, sdxl, sdxl-full, wan, flux2, dits2, dits3, captions, sd15-res (loop: done)
#
# Each step appends its table to bench/RESULTS.md and copies that file to $OUT (the device
# tool brings $OUT back), so the section can be committed here; the DiT steps also append
# each row to $OUT/dit-rows.jsonl as it finishes. Here, `bash bench/gpu_session.sh smoke`
# checks the scripts on the CPU and leaves RESULTS.md as it was.
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:?usage: bench/gpu_session.sh loop|sd15|sd15-res|sdxl|sdxl-full|dits|dits2|dits3|captions|wan|flux2|smoke}
WHEELS=${WHEELS:-.whl}
# The GPU machine has python3 with torch and no .venv (git-ignored, not carried); here the
# repo's .venv is the python that has torch.
if [ -x .venv/bin/python ]; then PY=${PYTHON:-.venv/bin/python}; else PY=${PYTHON:-python3}; fi
SITE=${SITE:-/tmp/raylora-site}
# On every exit, a failing step's under set -e too: the smoke step's tables come out of
# RESULTS.md again, and what a GPU step recorded goes back through $OUT.
before=$(mktemp)
cp bench/RESULTS.md "$before"
finish() {
  if [ "$step" = smoke ]; then cp "$before" bench/RESULTS.md; fi
  if [ -n "${OUT:-}" ]; then cp bench/RESULTS.md "$OUT/RESULTS.md"; fi
  rm -f "$before"
}
trap finish EXIT
if [ "$step" != smoke ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export RAYLORA_REV=${RAYLORA_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo "see the commit that records this")}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
# 540 s of the 600 s a call may run, counted from this script's start (the wheels' install
# is in it): the rows still to come are recorded as not run.
limit=$(( ${TIME_LIMIT:-540} - SECONDS ))
common=(--time-limit "$limit" --profile 3)
# The DiT steps: the same limit, and each row into $OUT as it finishes (kept even if the
# call is killed before the table is recorded).
dit=(--time-limit "$limit")
if [ -n "${OUT:-}" ]; then dit+=(--jsonl "$OUT/dit-rows.jsonl"); fi
case "$step" in
  # A whole run (loop, EMA, held-out loss, previews, checkpoints, resume) with
  # train.cuda_graphs against the same run without: what keeps the switch off by default.
  # A tiny SDXL, so the compile is short; each run compiles afresh.
  loop) "$PY" bench/gpu_loop_check.py --family sdxl --steps 16 ;;
  # SD 1.5 @512, cached: regional 26.3 % MFU, +gn16 28.1 %, regional-res+gn16 29.3 % (compile
  # 109 s) on an H200, 2026-11-26 22:19. Next: the kinds profile without inductor's ranges
  # counted (fixed after that run), and gn16 warm from the stored cache.
  sd15) "$PY" bench/gpu_throughput.py --models sd15 --batch-sizes 64 "${common[@]}" \
          --variants cached+regional,cached+regional+gn16,cached+regional+gn16+warm ;;
  # The resnets compiled too: their step time (the cold compile was past 90 s on an
  # H100), and how long a fresh process takes with the stored cache (train.compile_cache_uri).
  sd15-res) "$PY" bench/gpu_throughput.py --models sd15 --batch-sizes 64 "${common[@]}" \
          --compile-budget 300 --variants cached+regional-res,cached+regional-res+warm ;;
  # SDXL @1024: regional with CUDA graphs (train.cuda_graphs; 33% MFU on an H200), eager
  # beside it, with bf16 GroupNorms (gn16: training's default since 2026-11-26, measured on
  # SD 1.5 only), and its warm compile.
  sdxl) "$PY" bench/gpu_throughput.py --models sdxl --batch-sizes 8 "${common[@]}" \
          --variants cached,cached+regional+ro,cached+regional+ro+gn16,cached+regional+ro+gn16+warm ;;
  # SDXL full compile: its step time, with a compile budget of several minutes; then warm.
  sdxl-full) "$PY" bench/gpu_throughput.py --models sdxl --batch-sizes 8 "${common[@]}" \
          --compile-budget 420 --variants cached+full,cached+full+warm ;;
  # The DiT families with no GPU figures yet (Flux.2 [klein] 4B, Z-Image-Turbo) @1024,
  # cached, eager and regional, batch 1 and 2; the family's SDPA backends (cuDNN off, as
  # training runs them: with it on, the first case died of an illegal memory access).
  dits) "$PY" bench/gpu_dit.py --models klein4b,zimage --batch-sizes 1,2 "${dit[@]}" ;;
  wan) "$PY" bench/gpu_dit.py --models wan14b --batch-sizes 1,2 "${dit[@]}" ;;
  # Chroma1-HD, Qwen-Image (20B) and Qwen-Image-Edit (the same transformer over twice the
  # image tokens: the input's follow the noisy ones) @1024, cached, batch 1. Two steps of six
  # cases: twelve 2-20B cases (build, FLOP count, compile, steps) would likely pass 540 s.
  dits2) "$PY" bench/gpu_dit.py --models chroma,qwenimage,qwenedit --batch-sizes 1 "${dit[@]}" ;;
  dits3) "$PY" bench/gpu_dit.py --models qwenedit2,lumina2,sana --batch-sizes 1 "${dit[@]}" ;;
  # Z-Image-Turbo and Qwen-Image with captions of 4 lengths, regional: the dynamic-shape
  # kernels training runs once its batches' caption lengths differ, against one length in
  # the same run (each row's MFU from an eager step counted before its compile).
  captions) "$PY" bench/gpu_dit.py --models zimage,qwenimage --batch-sizes 1 --modes regional \
          --vary-captions 1,4 "${dit[@]}" ;;
  # Flux.2 [dev]'s 32B transformer (64 GB in bf16) @1024, batch 1, gradient checkpointing:
  # whether one GPU holds a LoRA step at all, and its MFU (an H200 has room; an H100 may not).
  flux2) "$PY" bench/gpu_dit.py --models flux2dev --batch-sizes 1 --gradient-checkpointing "${dit[@]}" ;;
  # CPU check of this script and the bench (toy widths; not a measurement: RESULTS.md is
  # restored on exit).
  smoke) "$PY" bench/gpu_throughput.py --smoke --models sd15 --batch-sizes 2 --profile 1 \
           --variants cached+regional
         "$PY" bench/gpu_loop_check.py --smoke --family sdxl --steps 4
         "$PY" bench/gpu_dit.py --smoke --models klein4b,zimage --modes none --vary-captions 1,2 \
           --time-limit 300 ;;
  *) echo "unknown step: $step" >&2; exit 2 ;;
esac
