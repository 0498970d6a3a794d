#!/usr/bin/env bash
# One whole GPU pass on the CUDA host: every GPU test, the sanitizers on tiny, both benchmarks, a CUDA training run
# of the offline CLI and the PyTorch reference against the CUDA backend.
# Usage (on the CUDA host): bench/gpu_pass.sh BUNDLE_DIR OUT_DIR [DATA_DIR]
# where BUNDLE_DIR comes from shared/tools/bundle-binaries with cuda_tests, engine_tests, bench_train, bench_stream
# and perception (and reference_dump, for tests/reference/compare.py on CUDA, where python3 has torch). Logs and JSON
# land in OUT_DIR; the last lines printed are the summary.
set -uo pipefail
bundle=$1 out=$2 data=${3:-}
run() { "$bundle/env" "$@"; }
summary=()

run cuda_tests > "$out/cuda_tests.log" 2>&1; summary+=("cuda_tests: exit $? $(grep -E '^\[  (PASSED|FAILED) ' "$out/cuda_tests.log" | tr '\n' ' ')")
run engine_tests --gtest_filter='*Stream*' > "$out/engine_streaming.log" 2>&1
summary+=("engine_tests streaming (cpu+cuda): exit $? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/engine_streaming.log" | tr '\n' ' ')")
run bench_train --json "$out/bench_train.json" > "$out/bench_train.log" 2>&1; summary+=("bench_train 3xtf32: exit $?")
run bench_train --precision=fp32 --configs small --json "$out/bench_train_fp32.json" > "$out/bench_train_fp32.log" 2>&1
summary+=("bench_train fp32: exit $?")
run bench_train --precision=tf32 --json "$out/bench_train_tf32.json" > "$out/bench_train_tf32.log" 2>&1; summary+=("bench_train tf32: exit $?")
run bench_stream --configs tiny,small --json "$out/bench_stream.json" > "$out/bench_stream.log" 2>&1
summary+=("bench_stream: exit $?")
run bench_stream --configs large --instruments 1,64,1024 --iterations 50 --json "$out/bench_stream_large.json" \
  >> "$out/bench_stream.log" 2>&1
summary+=("bench_stream large: exit $?")
if [ -n "$data" ]; then
  ob="$data/AMZN_2012-06-21_34200000_57600000_orderbook_1.csv" msg="$data/AMZN_2012-06-21_34200000_57600000_message_1.csv"
  # 60 steps, as gpu_e2e.sh trains: a 200-step run had its lowest validation at step 50 (0.631) and was past the
  # prior's by step 100 while its training loss kept falling (one day overfitted), so its last line said WORSE on any
  # backend.
  run perception train --device cuda --config small --lobster "$ob" "$msg" --steps 60 --batch 256 --val_every 20 \
    --save "$out/amzn_cuda.safetensors" > "$out/train_cuda.log" 2>&1
  summary+=("perception train --device cuda: exit $? $(tail -2 "$out/train_cuda.log" | head -1)")
fi
if [ -x "$bundle/bin/reference_dump" ]; then
  # PyTorch's autograd in float64 against the CUDA backend on small (B=256). compare.py runs reference_dump itself,
  # so through a wrapper that gives it the bundle's libraries.
  printf '#!/bin/sh\nexec "%s/env" reference_dump "$@"\n' "$bundle" > "$out/reference_dump"
  chmod +x "$out/reference_dump"
  for p in 3xtf32 fp32; do
    python3 "$(dirname "$0")/../tests/reference/compare.py" --device cuda --precisions float64 \
      --dump-bin "$out/reference_dump" --dir "$out/reference_$p" -- --config small --device cuda --float32 off \
      --threads 16 --precision "$p" > "$out/compare_$p.log" 2>&1
    summary+=("compare.py small on cuda, $p: exit $? $(tail -1 "$out/compare_$p.log")")
  done
fi
if command -v compute-sanitizer > /dev/null; then
  for tool in ${SANITIZERS:-memcheck racecheck}; do
    run compute-sanitizer --tool "$tool" --error-exitcode 3 cuda_tests --gtest_filter='*tiny*:*StreamStepManyTest.Malformed*:Configs/StreamStepTest.*/0' \
      > "$out/$tool.log" 2>&1
    summary+=("compute-sanitizer $tool (tiny): exit $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/$tool.log" | tail -1)")
  done
fi
cat "$out/bench_train.log" "$out/bench_train_fp32.log" "$out/bench_train_tf32.log" "$out/bench_stream.log" | grep -vE '^\s*$' | tail -40
printf "%s\n" "${summary[@]}" | tee "$out/summary.txt"
