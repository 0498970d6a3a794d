#!/usr/bin/env bash
# The daemon's Train stream end to end on a CUDA host: `perceptionctl train` steps/s (since the first answer) and the
# device's mean step time (perception_train_step_seconds), for each daemon given, alternating, on AMZN level 1
# (F = 12) and AAPL level 10 (F = 48, a batch of 3.1 MB of features), `small`'s training shape. A daemon is given as
# NAME=PROGRAM or NAME=PROGRAM:CLIENT, PROGRAM a perceptiond build in the bundle (another tree's, for a comparison in
# one call) and CLIENT the perceptionctl build that feeds it (perceptionctl where not given).
# Usage: bench/train_rpc_rate.sh BUNDLE_DIR OUT_DIR DATA_DIR STEPS ROUNDS NAME=PROGRAM[:CLIENT]...
# (DATASETS="aapl" times one of the two; ROTATE=1 starts each round one daemon further along the list, so that no
# daemon always runs first in its round.)
set -uo pipefail
bundle=$1 out=$2 data=$3 steps=$4 rounds=$5
shift 5
port=50171 metrics_port=9575
mkdir -p "$out"
amzn="$data/AMZN_2012-06-21_34200000_57600000_orderbook_1.csv $data/AMZN_2012-06-21_34200000_57600000_message_1.csv"
aapl="$data/AAPL_2012-06-21_34200000_57600000_orderbook_10.csv $data/AAPL_2012-06-21_34200000_57600000_message_10.csv"
printf '%-14s %-6s %-5s %10s %16s\n' daemon data round steps/s device_us/step
variants=("$@")
for round in $(seq "$rounds"); do
  order=("${variants[@]}")
  if [ "${ROTATE:-0}" = 1 ]; then
    shift_by=$(( (round - 1) % ${#variants[@]} ))
    order=("${variants[@]:shift_by}" "${variants[@]:0:shift_by}")
  fi
  for data_name in ${DATASETS:-amzn aapl}; do
    levels=1 files=$amzn
    [ "$data_name" = aapl ] && levels=10 files=$aapl
    for variant in "${order[@]}"; do
      name=${variant%%=*} program=${variant#*=} client=perceptionctl
      if [[ $program == *:* ]]; then client=${program#*:} program=${program%%:*}; fi
      "$bundle/env" "$program" --listen="127.0.0.1:$port" \
        --metrics_listen="127.0.0.1:$metrics_port" --device=cuda --checkpoint_dir="$out/ckpt" 2> "$out/daemon.log" &
      pid=$!
      ctl=("$bundle/env" "$client" --target="127.0.0.1:$port")
      "${ctl[@]}" --wait=60s status > /dev/null
      "${ctl[@]}" init --config small --levels "$levels" > /dev/null
      rate=$("${ctl[@]}" train --lobster $files --steps "$steps" --log-every "$steps" 2>&1 |
             awk '/steps\/s/ {for (i = 1; i < NF; ++i) if ($(i + 1) == "steps/s") r = $i} END {print r}')
      device=$(python3 -c "
import sys, urllib.request
text = urllib.request.urlopen('http://127.0.0.1:$metrics_port/metrics').read().decode()
v = {l.split()[0]: float(l.split()[1]) for l in text.splitlines() if l.startswith('perception_train_step_seconds_')}
print('%.1f' % (v['perception_train_step_seconds_sum'] / v['perception_train_step_seconds_count'] * 1e6))")
      kill -TERM "$pid"; wait "$pid"
      printf '%-14s %-6s %-5s %10s %16s\n' "$name" "$data_name" "$round" "$rate" "$device"
    done
  done
done
