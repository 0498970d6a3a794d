#!/usr/bin/env bash
# What a long SeedStream costs another instrument's events: perceptionctl bench's latencies on one instrument, paced,
# alone and while a window of the AMZN day seeds another, for each --stream_seed_job_us given (a large one stands for
# the window as few jobs as the part sizing allows: each part at most four times the one before).
# Usage: bench/seed_latency.sh BUNDLE_DIR OUT_DIR DATA_DIR DEVICE WINDOW JOB_US...   (bundle: perceptiond, perceptionctl)
set -uo pipefail
bundle=$1 out=$2 data=$3 device=$4 window=$5
shift 5
ob="$data/AMZN_2012-06-21_34200000_57600000_orderbook_1.csv" msg="$data/AMZN_2012-06-21_34200000_57600000_message_1.csv"
port=50171
mkdir -p "$out"
ctl=("$bundle/env" perceptionctl --target="127.0.0.1:$port" --timeout=120s)
for job_us in "$@"; do
  "$bundle/env" perceptiond --listen="127.0.0.1:$port" --metrics_listen= --device="$device" --init_config=small \
    --init_levels=1 --stream_seed_job_us="$job_us" 2> "$out/perceptiond_$job_us.log" &
  daemon=$!
  "${ctl[@]}" --wait=60s status > /dev/null
  "${ctl[@]}" bench --instruments 1 --events 500 > /dev/null  # warm: streaming configured, kernels loaded
  echo "--stream_seed_job_us=$job_us, alone:       $("${ctl[@]}" bench --instruments 1 --events 3000 --rate 1000 |
    grep -o 'p50.*')"
  ("${ctl[@]}" stream --lobster "$ob" "$msg" --instrument SEEDED --seed-window "$window" --count $((window + 1)) \
     > "$out/seed_$job_us.txt" 2>&1) &
  seeding=$!
  echo "--stream_seed_job_us=$job_us, beside seed: $("${ctl[@]}" bench --instruments 1 --events 3000 --rate 1000 |
    grep -o 'p50.*')"
  wait $seeding
  echo "  the seed: $(grep -io 'seeded.*' "$out/seed_$job_us.txt" | head -1)"
  kill -TERM $daemon
  wait $daemon
done
