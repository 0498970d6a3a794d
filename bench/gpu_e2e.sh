#!/usr/bin/env bash
# End to end on a CUDA host: perceptiond --device cuda trains on AMZN through perceptionctl, streams events, and the
# convictions read back are compared with the offline `perception eval --device cuda`; then perceptionctl bench.
# A second instrument's lone events arrive 6.7 ms apart, longer than the daemon's 5 ms idle period, so the resident
# step is stopped and started again between them; their convictions are compared with the offline evaluation too.
# Usage: bench/gpu_e2e.sh BUNDLE_DIR OUT_DIR DATA_DIR   (bundle: perceptiond, perceptionctl, perception)
set -uo pipefail
bundle=$1 out=$2 data=$3
ob="$data/AMZN_2012-06-21_34200000_57600000_orderbook_1.csv" msg="$data/AMZN_2012-06-21_34200000_57600000_message_1.csv"
port=50151 metrics_port=9565 events=15000 paced_events=200
mkdir -p "$out/checkpoints"
"$bundle/env" perceptiond --listen="127.0.0.1:$port" --metrics_listen="127.0.0.1:$metrics_port" --device=cuda \
  --checkpoint_dir="$out/checkpoints" --stream_resident_idle_ms=5 2> "$out/perceptiond.log" &
daemon=$!
ctl=("$bundle/env" perceptionctl --target="127.0.0.1:$port")
"${ctl[@]}" --wait=60s status | head -3
"${ctl[@]}" init --config small --levels 1 --batch 256 --window 64 --lr 1e-3 --lr_schedule cosine \
  --lr_warmup_steps 10 --total_steps 60 --min_lr 1e-4
# The daemon runs with its default --precision (auto), which on CUDA is 3xtf32.
"${ctl[@]}" status | sed -n 2p | tee "$out/device.txt"
echo "default precision on cuda: $(grep -q 'precision 3xtf32$' "$out/device.txt" && echo PASS || echo FAIL)"
"${ctl[@]}" train --lobster "$ob" "$msg" --steps 60 | tail -3
"${ctl[@]}" checkpoint save gpu.safetensors
"${ctl[@]}" stream --lobster "$ob" "$msg" --instrument AMZN --count "$events" | tail -2
# Once the call has its acknowledgements, ListStreams counts every event processed (their ticks finished), none pending.
"${ctl[@]}" streams | tee "$out/streams.txt"
echo "listed AMZN with $events events processed, none pending: $(awk -v n="$events" \
  '$1 == "AMZN" && $3 == n && $4 == 0 {ok = 1} END {print ok ? "PASS" : "FAIL"}' "$out/streams.txt")"
"${ctl[@]}" convictions --instrument AMZN --out "$out/convictions.csv" | tail -1
"${ctl[@]}" bench --instruments 1 --events 20000 | tail -4
"${ctl[@]}" bench --instruments 100 --events 50000 | tail -4
# A lone event leaves the resident step running; closing the streams (each resets its slot, which stops it) and
# replacing the model (ModelHost::NewBackend quiesces the old one first) must not hang, and streaming goes on.
"${ctl[@]}" stream --lobster "$ob" "$msg" --instrument AMZN2 --count "$paced_events" --rate 150 | tail -1
"${ctl[@]}" convictions --instrument AMZN2 --out "$out/paced_convictions.csv" | tail -1
"${ctl[@]}" streams close AMZN | tail -1
"${ctl[@]}" streams close AMZN2 | tail -1
"${ctl[@]}" init --config small --levels 1 --replace | tail -1
"${ctl[@]}" stream --lobster "$ob" "$msg" --instrument AMZN3 --count 50 | tail -1
shown='train_step_seconds_(sum|count)|train_graph_(captures|replays)_total|stream_step_seconds_(sum|count)'
shown+='|stream_tick_device_seconds_(sum|count)|stream_events_total|stream_weights_version'
shown+='|stream_resident_idle_stops_total'
python3 - "$metrics_port" <<'PY' | tee "$out/metrics.txt" | grep -E "^perception_($shown)"
import sys, urllib.request
print(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics").read().decode())
PY
kill -TERM "$daemon"; wait "$daemon"; echo "perceptiond exit code $?"
# The paced stream's pauses must have stopped the resident step (a level-1 small model has one on an H100 or H200):
# about once an event, at least once every other one whatever the client's pacing jitter.
stops=$(awk '/^perception_stream_resident_idle_stops_total /{print $2}' "$out/metrics.txt")
echo "resident step stopped for idleness ${stops:-0} times over $paced_events paced events:" \
  "$([ "${stops:-0}" -ge $((paced_events / 2)) ] && echo PASS || echo FAIL)"
# The device time of the ticks: the benches' ticks of many instruments were launched (CUDA events around each), the
# lone events went through the resident step (its stamps, read while a run goes on and at its stop): each path some, a
# mean between 1 µs and 10 ms.
for path in launched resident; do
  awk -v path="$path" -F'[ ]' '
    $1 == "perception_stream_tick_device_seconds_count{path=\"" path "\"}" {n = $2}
    $1 == "perception_stream_tick_device_seconds_sum{path=\"" path "\"}" {s = $2}
    END {printf "%s ticks timed on the device: %d, mean %.2f us: %s\n", path, n, n ? s / n * 1e6 : 0,
         (n > 0 && s / n > 1e-6 && s / n < 1e-2) ? "PASS" : "FAIL"}' "$out/metrics.txt"
done
# Every lone event was timed, the busy 1-instrument bench's included (read while its run went on), but the last
# run's latest, whose stamp is read only at a check after its stop and none followed before the scrape; one more to
# spare (a stamp the host never saw whole is read at its run's stop, which may also come after the scrape).
awk '/^perception_stream_tick_instruments_bucket\{le="1"\} /{lone = $2}
  $1 == "perception_stream_tick_device_seconds_count{path=\"resident\"}" {timed = $2}
  END {printf "lone events timed on the device: %d of %d: %s\n", timed, lone,
       (lone > 0 && timed <= lone && timed >= lone - 2) ? "PASS" : "FAIL"}' "$out/metrics.txt"
# Back-pressure on the device: a daemon bounded at 512 pending events over 4 connections of 256 instruments, each
# with 8 requests in flight (8,192 events offered): the Stream calls are held at the bound and every event is
# processed and acknowledged, none lost. It times every launched tick (--stream_tick_timing=1).
"$bundle/env" perceptiond --listen="127.0.0.1:$((port + 1))" --metrics_listen="127.0.0.1:$((metrics_port + 1))" \
  --device=cuda --checkpoint_dir="$out/checkpoints" --stream_max_pending_events=512 --stream_slots=1024 \
  --init_config=small --stream_tick_timing=1 2> "$out/perceptiond_bounded.log" &
bounded=$!
bounded_ctl=("$bundle/env" perceptionctl --target="127.0.0.1:$((port + 1))")
"${bounded_ctl[@]}" --wait=60s bench --instruments 1024 --events 200000 --connections 4 --in-flight 8 \
  | tee "$out/bench_bounded.txt" | tail -3
python3 - "$((metrics_port + 1))" <<'PY' > "$out/metrics_bounded.txt"
import sys, urllib.request
print(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics").read().decode())
PY
kill -TERM "$bounded"; wait "$bounded"; echo "bounded perceptiond exit code $?"
held=$(awk '/^perception_stream_reads_held_total /{print $2}' "$out/metrics_bounded.txt")
processed=$(awk '/^perception_stream_events_total /{print $2}' "$out/metrics_bounded.txt")
echo "bounded daemon: reads held ${held:-0} times, ${processed:-0} of 200000 events processed:" \
  "$([ "${held:-0}" -ge 1 ] && [ "${processed:-0}" = 200000 ] && grep -q '^not acknowledged: 0 events' \
       "$out/bench_bounded.txt" && echo PASS || echo FAIL)"
# Every tick of more than one event was launched (lone ones go to the resident step) and timed once.
awk '/^perception_stream_tick_instruments_count /{ticks = $2}
  /^perception_stream_tick_instruments_bucket\{le="1"\} /{lone = $2}
  $1 == "perception_stream_tick_device_seconds_count{path=\"launched\"}" {timed = $2}
  END {printf "bounded daemon, every tick timed: %d launched ticks timed, %d ticks of more than one event: %s\n", timed,
       ticks - lone, (timed > 0 && timed == ticks - lone) ? "PASS" : "FAIL"}' "$out/metrics_bounded.txt"
# A lost device: the streaming tick numbered by --inject_device_loss_at_tick executes `trap` (a real sticky error),
# once among lone paced events, inside the running resident step, and once among launched ticks (100 instruments), in
# a kernel of its own. The stream ends UNAVAILABLE naming the failed call and the CUDA error, and the daemon drains
# and exits 1, hanging on nothing.
lose_device() {  # NAME PORT FAILED-CALL perceptionctl-arguments... (FAILED-CALL: the call the error must name)
  local name=$1 lost_port=$2 failed_call=$3
  shift 3
  "$bundle/env" perceptiond --listen="127.0.0.1:$lost_port" --metrics_listen= --device=cuda \
    --checkpoint_dir="$out/checkpoints" --inject_device_loss_at_tick=300 2> "$out/perceptiond_lost_$name.log" &
  local lost=$! waited=0
  local lost_ctl=(timeout -s KILL 45 "$bundle/env" perceptionctl --target="127.0.0.1:$lost_port")
  "${lost_ctl[@]}" --wait=60s init --config small --levels 1 > "$out/lost_$name.txt" 2>&1
  "${lost_ctl[@]}" "$@" >> "$out/lost_$name.txt" 2>&1
  local ctl_code=$?
  while kill -0 "$lost" 2>/dev/null && [ "$waited" -lt 30 ]; do sleep 1; waited=$((waited + 1)); done
  kill -KILL "$lost" 2>/dev/null
  wait "$lost"
  local code=$?
  tail -1 "$out/lost_$name.txt" | cut -c1-400
  local named=0
  grep -q "UNAVAILABLE.*$failed_call.*cudaErrorLaunchFailure" "$out/lost_$name.txt" && named=1
  echo "lost device ($name): perceptionctl exit $ctl_code, perceptiond exit $code within $waited s:" \
    "$([ "$ctl_code" = 1 ] && [ "$code" = 1 ] && [ "$named" = 1 ] && echo PASS || echo FAIL)"
}
# Lone events at 1,000 a second keep the resident step running (it is released after 1 s idle): the trap is inside it.
lose_device resident $((port + 2)) 'cudaStreamQuery(the resident step' \
  stream --lobster "$ob" "$msg" --instrument AMZN --count 2000 --rate 1000
lose_device launched $((port + 3)) 'cudaStreamSynchronize' bench --instruments 100 --events 100000
"$bundle/env" perception eval --device cuda --checkpoint "$out/checkpoints/gpu.safetensors" --lobster "$ob" "$msg" \
  --out "$out/eval_logits.npy" | tail -1
python3 - "$out" "$events" "$paced_events" <<'PY'
import sys, numpy as np
out = sys.argv[1]
for name, prefix, n in (("AMZN", "", int(sys.argv[2])), ("AMZN2 (paced)", "paced_", int(sys.argv[3]))):
    rows = np.loadtxt(f"{out}/{prefix}convictions.csv", delimiter=",", skiprows=1)
    logits = np.load(f"{out}/eval_logits.npy")[:n].astype(np.float64)
    p = 1 / (1 + np.exp(-logits))
    k = np.argmax(np.abs(p - 0.5), axis=1)
    expected = 2 * p[np.arange(n), k] - 1
    assert rows.shape[0] == n and (rows[:, 0] == np.arange(1, n + 1)).all(), f"{name}: sequence numbers"
    conv_err = np.abs(rows[:, 1] - expected).max()
    prob_err = np.abs(rows[:, 2:] - p).max()
    print(f"{name} streamed on cuda vs perception eval --device cuda over {n} events: max |conviction diff| "
          f"{conv_err:.2e}, max |probability diff| {prob_err:.2e}: "
          f"{'PASS' if conv_err <= 1e-5 and prob_err <= 1e-5 else 'FAIL'}")
PY
