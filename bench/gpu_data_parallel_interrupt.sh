#!/usr/bin/env bash
# perceptionctl train's Ctrl-C against a two-GPU data-parallel job: each round trains `small` on two ranks, signals the
# client (SIGTERM: a script's background job has SIGINT ignored, and perceptionctl treats the two alike) a few seconds
# in, then reads both ranks' steps and trains 20 more steps across them with the replica check every 10 steps: the
# job must still train, its ranks at one step. With OLD_CTL (a perceptionctl without the interruption), the same
# rounds show what the signal did before (the job restarted after a round that broke it).
# Usage: bench/gpu_data_parallel_interrupt.sh BUNDLE_DIR OUT_DIR DATA_DIR [ROUNDS]   (bundle: perceptiond, perceptionctl)
set -uo pipefail
bundle=$1 out=$2 data=$3 rounds=${4:-5}
ob="$data/AMZN_2012-06-21_34200000_57600000_orderbook_1.csv" msg="$data/AMZN_2012-06-21_34200000_57600000_message_1.csv"
export NCCL_NVLS_ENABLE=0
targets=127.0.0.1:50810,127.0.0.1:50811
mkdir -p "$out"
pids=()
start() {
  pids=()
  for r in 0 1; do
    CUDA_VISIBLE_DEVICES=$r "$bundle/env" perceptiond --device=cuda --listen="127.0.0.1:$((50810 + r))" \
      --metrics_listen= --checkpoint_dir="$out/ck" --world_size=2 --rank=$r --peers="$targets" \
      --collective_timeout=5s --replica_check_every=10 2>> "$out/rank$r.log" &
    pids+=($!)
  done
  "$bundle/env" perceptionctl --targets="$targets" --wait=60s init --config small --levels 1 --seed 1 > /dev/null
}
stop() { kill -TERM "${pids[@]}" 2> /dev/null; wait "${pids[@]}" 2> /dev/null; }
steps_of() { "$bundle/env" perceptionctl --target="$1" --timeout=10s status 2>&1 | sed -n 's/^  step \([0-9]*\),.*/\1/p'; }

run_rounds() {  # LABEL CTL
  local label=$1 ctl=$2
  start
  for ((i = 1; i <= rounds; i++)); do
    "$bundle/env" "$ctl" --targets="$targets" --timeout=60s train --lobster "$ob" "$msg" --steps 100000 \
      > "$out/${label}_$i.txt" 2>&1 &
    local trainer=$!
    sleep 4
    kill -TERM "$trainer"
    wait "$trainer"
    local code=$?
    sleep 1
    local s0 s1 more
    s0=$(steps_of 127.0.0.1:50810) s1=$(steps_of 127.0.0.1:50811)
    "$bundle/env" perceptionctl --targets="$targets" --timeout=30s train --lobster "$ob" "$msg" --steps 20 \
      > "$out/${label}_${i}_more.txt" 2>&1
    more=$?
    echo "$label round $i: exit $code; rank steps $s0 / $s1; 20 more steps: exit $more" \
      "$( [ $more -ne 0 ] && tail -1 "$out/${label}_${i}_more.txt" | cut -c1-160)"
    grep -h "interrupted after" "$out/${label}_$i.txt" | cut -c1-200
    if [ $more -ne 0 ]; then stop; start; fi
  done
  stop
}

run_rounds new "$bundle/bin/perceptionctl"
[ -n "${OLD_CTL:-}" ] && run_rounds old "$OLD_CTL"
exit 0
