#!/usr/bin/env python3
"""How far narrower SSM states would move a streamed model's outputs: the step path (MODEL.md §3) over a real day's
events in float64 (the oracle), in float32 (the contract), and in float32 with the [Hh, P, N] SSM states rounded to
bfloat16 or float16 after every event, as a kernel that stores them narrow would. The conv and CfC states stay float32.

The day is cut into --streams contiguous segments, each streamed from zero state as one instrument. Prints, per mode,
the convictions' and probabilities' distance from the oracle (max, 99.9th percentile), the events whose conviction
changes sign (where the oracle's is at least 0.01) or whose strongest horizon changes, and the largest |state| seen
(float16's range is 65,504).

Usage: state_precision.py --checkpoint CKPT --features FEATURES.npy [--logits LOGITS.npy] [--streams 16]
       [--device cuda] [--json OUT]
(FEATURES.npy: `perception eval --features_out`, [events, F + 1], raw features then Δt. LOGITS.npy, from the same
eval: segment 0's float32 logits are checked against the engine's, to show the harness streams what the engine does.)
"""
import argparse
import json
import sys

import numpy as np
import torch

import perception_ref as ref

# Sign changes count where the oracle's conviction is at least this strong (nearer zero, either sign is noise).
SIGN_FLOOR = 0.01
# Each mode: the dtype it computes in, and the dtype its SSM states are rounded to after every event (None: kept).
MODES = {"float64": (torch.float64, None), "float32": (torch.float32, None),
         "bfloat16 states": (torch.float32, torch.bfloat16), "float16 states": (torch.float32, torch.float16)}


def stream(model, u, dt, narrow, dtype):
    """Steps every segment through its events: u [S, L, F], dt [S, L] → logits [S, L, H], max |ssm state|."""
    S, L, _ = u.shape
    state = ref.State.zeros(model.cfg, S, dtype=dtype, device=u.device)
    logits, largest = [], torch.zeros((), dtype=dtype, device=u.device)
    for t in range(L):
        out, state = model.step(u[:, t].to(dtype), dt[:, t].to(dtype), state, inplace=True)
        for s in state.ssm:
            largest = torch.maximum(largest, s.abs().max())
            if narrow is not None:
                s.copy_(s.to(narrow).to(dtype))
        logits.append(out)
    return torch.stack(logits, dim=1), largest.item()


def compare(logits, oracle):
    logits = logits.double()
    p, p_ref = torch.sigmoid(logits), torch.sigmoid(oracle)
    conv, conv_ref = ref.conviction(logits), ref.conviction(oracle)
    diff = (conv - conv_ref).abs()  # [S, L]
    flips = ((conv > 0) != (conv_ref > 0)) & (conv_ref.abs() >= SIGN_FLOOR)
    return {
        "conviction_max": diff.max().item(),
        "conviction_p999": torch.quantile(diff.flatten().float().cpu(), 0.999).item(),
        "conviction_mean": diff.mean().item(),
        "probability_max": (p - p_ref).abs().max().item(),
        "sign_changes": int(flips.sum().item()),
        "strongest_horizon_changes": int((ref.strongest_horizon(logits) != ref.strongest_horizon(oracle)).sum().item()),
        # The error at the segments' ends against their starts: whether it accumulates along a stream.
        "conviction_max_first_100": diff[:, :100].max().item(),
        "conviction_max_last_100": diff[:, -100:].max().item(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--features", required=True)
    parser.add_argument("--logits")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")

    features = torch.from_numpy(np.load(args.features)).to(args.device)
    S = args.streams
    L = features.shape[0] // S
    segments = features[: S * L].view(S, L, -1).double()
    u, dt = segments[..., :-1], segments[..., -1]

    results = {"events": S * L, "streams": S, "events_a_stream": L, "device": args.device, "modes": {}}
    logits = {}
    with torch.no_grad():
        for name, (dtype, narrow) in MODES.items():
            model, _, _ = ref.load_checkpoint(args.checkpoint, dtype=dtype, device=args.device)
            model.eval()
            logits[name], largest = stream(model, u, dt, narrow, dtype)
            results["modes"][name] = {"largest_state": largest}
        oracle = logits["float64"]
        for name in MODES:
            if name != "float64":
                results["modes"][name].update(compare(logits[name], oracle))
        if args.logits:
            engine = torch.from_numpy(np.load(args.logits)[:L]).to(args.device).double()
            ours = logits["float32"][0].double()
            results["engine_segment0_logits_rel_err"] = ((ours - engine).norm() / engine.norm()).item()

    print(f"{S * L} events, {S} streams of {L}, {args.device}; distance from float64:")
    print("| mode | conviction max | p99.9 | mean | probability max | sign changes | strongest horizon changes "
          "| max first 100 / last 100 events | largest abs state |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results["modes"].items():
        if name == "float64":
            continue
        print(f"| {name} | {r['conviction_max']:.3g} | {r['conviction_p999']:.3g} | {r['conviction_mean']:.3g} "
              f"| {r['probability_max']:.3g} | {r['sign_changes']} | {r['strongest_horizon_changes']} "
              f"| {r['conviction_max_first_100']:.3g} / {r['conviction_max_last_100']:.3g} "
              f"| {r['largest_state']:.4g} |")
    if "engine_segment0_logits_rel_err" in results:
        print(f"segment 0 float32 logits against the engine's eval: {results['engine_segment0_logits_rel_err']:.3g} "
              "relative")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
