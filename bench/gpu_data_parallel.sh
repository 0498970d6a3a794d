#!/usr/bin/env bash
# Data-parallel scaling on a host with 2+ GPUs (issue 8): `small` and `large` trained through perceptiond on 1 and
# 2 GPUs (one daemon per GPU, NCCL world of 1 or 2, perceptionctl --targets), steps/s and samples/s (windows of the
# global batch per second); then rank 1 is killed mid-training and rank 0 must fail its step within the timeout.
# Usage: bench/gpu_data_parallel.sh BUNDLE_DIR OUT_DIR DATA_DIR   (bundle: perceptiond, perceptionctl; see README)
set -uo pipefail
bundle=$1 out=$2 data=$3
ob="$data/AMZN_2012-06-21_34200000_57600000_orderbook_1.csv" msg="$data/AMZN_2012-06-21_34200000_57600000_message_1.csv"
export NCCL_NVLS_ENABLE=0
steps=200 timeout=20s
mkdir -p "$out"
pids=()
start() {  # N: one daemon per GPU, ranks 0..N-1 on ports 50800+r
  local n=$1 peers=""
  for ((r = 0; r < n; r++)); do peers+="${peers:+,}127.0.0.1:$((50800 + r))"; done
  targets=$peers pids=()
  for ((r = 0; r < n; r++)); do
    CUDA_VISIBLE_DEVICES=$r "$bundle/env" perceptiond --device=cuda --listen="127.0.0.1:$((50800 + r))" \
      --metrics_listen= --checkpoint_dir="$out/ck" --world_size="$n" --rank="$r" --peers="$peers" \
      --collective_timeout="$timeout" 2> "$out/rank$r.log" &
    pids+=($!)
  done
}
stop() { kill -TERM "${pids[@]}" 2> /dev/null; wait "${pids[@]}" 2> /dev/null; }
ctl() { "$bundle/env" perceptionctl --targets="$targets" --timeout=60s "$@"; }

printf "%-6s %5s %9s %12s %10s\n" config gpus steps/s samples/s efficiency
for config in small large; do
  base=""
  for n in 1 2; do
    start "$n"
    ctl --wait=60s init --config "$config" --levels 1 --seed 1 > /dev/null
    batch=$(ctl status | sed -n 's/.*trains on \([0-9]*\) x.*/\1/p' | head -1)
    rate=$(ctl train --lobster "$ob" "$msg" --steps "$steps" --log-every "$steps" | sed -n 's/.*  \([0-9.]*\) steps\/s.*/\1/p' | tail -1)
    stop
    samples=$(awk "BEGIN{print $rate * $n * $batch}")
    [ -z "$base" ] && base=$samples
    printf "%-6s %5d %9.2f %12.0f %9.0f%%\n" "$config" "$n" "$rate" "$samples" "$(awk "BEGIN{print 100 * $samples / ($n * $base)}")"
  done
done

echo "== kill rank 1 mid-training (collective timeout $timeout)"
start 2
ctl --wait=60s init --config small --levels 1 --seed 1 > /dev/null
ctl train --lobster "$ob" "$msg" --steps 100000 > "$out/killed_train.txt" 2>&1 &
trainer=$!
sleep 10
kill -9 "${pids[1]}"
killed=$(date +%s.%N)
wait "$trainer"
echo "perceptionctl exit $? $(awk "BEGIN{print $(date +%s.%N) - $killed}") s after the kill: $(tail -1 "$out/killed_train.txt")"
# Rank 0's step in flight waited on the dead peer: after the collective timeout it must have failed and aborted the
# communicator, so a further step is refused with the reason (FAILED_PRECONDITION) rather than hanging.
sleep "${timeout%s}"; sleep 5
"$bundle/env" perceptionctl --target=127.0.0.1:50800 --timeout=10s train --lobster "$ob" "$msg" --steps 1 2>&1 | tail -2
echo "perceptionctl exit ${PIPESTATUS[0]} for a step on rank 0 alone"
grep -E 'NCCL|DEADLINE|ABORTED|FAILED_PRECONDITION' "$out/rank0.log" | tail -3
stop
