#!/usr/bin/env python3
"""The PyTorch performance peer of perceptiond (issue 6): PerceptionNet v1 as a strong PyTorch user runs it.

    python3 tests/reference/bench_peer.py                       # CUDA: tiny, small, large; table on stdout
    python3 tests/reference/bench_peer.py --configs small --json peer.json
    python3 tests/reference/bench_peer.py --device cpu          # smoke mode: tiny, a few iterations

Measured, per config (B, T from the config unless --batch/--window), per math mode (fp32: TF32 off for
matmuls and cuDNN; tf32: on), eager and under one torch.cuda.CUDAGraph:
  * train: the full training step on a fixed batch held in static device tensors: forward (SSD chunked
    SSM, causal depthwise conv1d, CfC loop over time, GRN head), masked BCE, backward, global-norm
    clipping (clip_grad_norm_, foreach) and torch.optim.AdamW(capturable=True, foreach=True) with
    MODEL.md §4's weight-decay groups. Graph capture follows the PyTorch docs' whole-network recipe:
    warmup iterations on a side stream, zero_grad(set_to_none=True), capture, then replay().
  * stream: one event through the step path (MODEL.md §3) for S streams (default 1 and 1024), state in
    static tensors updated in place (so a replay advances the streams), under no_grad.
With --stage-inputs, each timed iteration also copies its inputs from pinned host memory (and, for
stream, the logits back), as a server would.

Timing: CUDA events around every iteration after warmup; the median (and p10/p90) of --iters
iterations, plus the mean wall-clock time per iteration of the whole timed loop (one sync at the end).
Eager steps are mostly bound by kernel launches, so event time and wall time agree closely there.
GFLOP/step is counted from the shapes (matmuls and the SSD's chunk products, ×3 for forward+backward);
TFLOP/s = that over the median. --count-kernels lists the CUDA kernels of one eager step (profiler).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

try:
    import torch
except ImportError as e:  # a python without torch: ctest's SKIP, as compare.py's
    print(f"SKIP: bench_peer.py needs torch ({e}); pip install torch safetensors numpy", flush=True)
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import perception_ref as ref  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Work counts


def train_gflop(cfg: ref.ModelConfig, B: int, T: int, chunk: int) -> float:
    """Floating-point operations of one training step (forward ×3 for forward + backward), in GFLOP."""
    D, E, N, P, Hh, L = cfg.d_model, cfg.d_inner, cfg.d_state, cfg.headdim, cfg.n_heads, cfg.n_layers
    C, K, G, H, F, DC = cfg.cfc_units, cfg.cfc_backbone, cfg.grn_hidden, cfg.n_horizons, cfg.n_features, \
        cfg.head_input
    tok = B * T
    Q = max(1, min(chunk, T))
    nc = math.ceil(T / Q)
    dense = F * D + L * (D * cfg.in_proj_dim + E * D) + DC * K + 4 * K * C + DC * G + 3 * G * G + DC * G + G * H
    fwd = 2 * tok * dense
    ssd = B * nc * (2 * Q * Q * N + Hh * (2 * Q * Q * P + 2 * Q * P * N + 2 * Q * N * P))
    fwd += L * ssd
    return 3 * fwd / 1e9


# ---------------------------------------------------------------------------------------------
# Timing


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


def time_cuda(fn, iters: int, warmup: int) -> dict:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    t0 = time.perf_counter()
    for i in range(iters):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / iters * 1e6
    us = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    return {"median_us": statistics.median(us), "p10_us": pct(us, 0.1), "p90_us": pct(us, 0.9),
            "wall_us": wall, "iters": iters}


def time_cpu(fn, iters: int, warmup: int) -> dict:
    for _ in range(warmup):
        fn()
    us = []
    t0 = time.perf_counter()
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        us.append((time.perf_counter() - t) * 1e6)
    wall = (time.perf_counter() - t0) / iters * 1e6
    return {"median_us": statistics.median(us), "p10_us": pct(us, 0.1), "p90_us": pct(us, 0.9),
            "wall_us": wall, "iters": iters}


def set_math_mode(mode: str) -> None:
    tf32 = mode == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def count_kernels(fn) -> int:
    """CUDA kernels launched by one call of fn (torch.profiler); -1 if the profiler is unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())
    except Exception as e:  # noqa: BLE001 - a missing profiler must not stop the benchmark
        print(f"  (kernel count unavailable: {e})", file=sys.stderr)
        return -1


# ---------------------------------------------------------------------------------------------
# The model, batch and state


def build(cfg: ref.ModelConfig, device, chunk: int, seed: int = 0) -> ref.PerceptionNet:
    model = ref.PerceptionNet(cfg, chunk=chunk)
    model.init_parameters(seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.norm.mean.copy_(torch.randn(cfg.n_features, generator=g) * 0.1)
        model.norm.inv_std.copy_(torch.rand(cfg.n_features, generator=g) + 0.5)
    return model.to(device)


def random_batch(cfg: ref.ModelConfig, B: int, T: int, device, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(B, T, cfg.n_features, generator=g) * 4 - 2
    dt = -0.5 * torch.log1p(-torch.rand(B, T, generator=g))
    y = (torch.rand(B, T, cfg.n_horizons, generator=g) < 0.5).float()
    m = (torch.rand(B, T, cfg.n_horizons, generator=g) < 0.8).float()
    m[:, :min(cfg.warmup, T - 1)] = 0
    return [t.to(device) for t in (x, dt, y, m)]


# ---------------------------------------------------------------------------------------------
# Benchmarks


def capture_after_warmup(warm, body):
    """The PyTorch docs' whole-network capture: `warm` three times on a side stream (lazy optimizer state, cuBLAS
    workspaces, autograd's streams), then `body` captured into one CUDAGraph; returns the graph and body's result."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            warm()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = body()
    return graph, result


def bench_train(cfg, B, T, device, mode, args) -> list:
    cuda = device.type == "cuda"
    if cuda:
        set_math_mode(mode)
    model = build(cfg, device, args.chunk)
    opt = ref.make_optimizer(model, lr=1e-3, capturable=cuda, foreach=True)
    params = [p for p in model.parameters()]
    static = random_batch(cfg, B, T, device)
    host = [t.cpu().pin_memory() if cuda else t.clone() for t in static] if args.stage_inputs else None

    def stage():
        if host is not None:
            for d, h in zip(static, host):
                d.copy_(h, non_blocking=True)

    def forward_backward():
        x, dt, y, m = static
        loss = ref.masked_bce(model(x, dt), y, m)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.max_norm, foreach=True)
        opt.step()
        return loss

    def eager_step():
        stage()
        opt.zero_grad(set_to_none=True)
        return forward_backward()

    gflop = train_gflop(cfg, B, T, args.chunk)
    timer = time_cuda if cuda else time_cpu
    rows = []
    base = {"config": args.config_name, "B": B, "T": T, "mode": mode, "what": "train", "streams": None,
            "gflop": gflop, "chunk": args.chunk, "stage_inputs": bool(args.stage_inputs)}

    r = timer(eager_step, args.iters_eager, args.warmup)
    if cuda and args.count_kernels:
        r["kernels"] = count_kernels(eager_step)
    rows.append({**base, "impl": "eager", **r})

    if cuda and not args.no_graph:
        def warm_step():
            eager_step()
            opt.zero_grad(set_to_none=True)  # so backward allocates the grads from the graph's pool

        graph, static_loss = capture_after_warmup(warm_step, forward_backward)

        def graph_step():
            stage()
            graph.replay()

        r = timer(graph_step, args.iters, args.warmup)
        if not torch.isfinite(static_loss).item():
            raise RuntimeError(f"{args.config_name} {mode}: the replayed step produced a non-finite loss")
        r["final_loss"] = static_loss.item()
        rows.append({**base, "impl": "graph", **r})
        del graph
    return rows


def bench_stream(cfg, streams, device, mode, args) -> list:
    cuda = device.type == "cuda"
    if cuda:
        set_math_mode(mode)
    model = build(cfg, device, args.chunk)
    model.requires_grad_(False)
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(streams, cfg.n_features, generator=g) * 4 - 2).to(device)
    dt = torch.rand(streams, generator=g).to(device)
    state = ref.State.zeros(cfg, streams, device=device)
    out = torch.zeros(streams, cfg.n_horizons, device=device)
    host_x = x.cpu().pin_memory() if (cuda and args.stage_inputs) else None
    host_dt = dt.cpu().pin_memory() if (cuda and args.stage_inputs) else None
    host_out = out.cpu().pin_memory() if (cuda and args.stage_inputs) else None

    @torch.no_grad()
    def compute():
        logits, _ = model.step(x, dt, state, inplace=True)  # the static state advances in place
        out.copy_(logits)

    def stage_in():
        if host_x is not None:
            x.copy_(host_x, non_blocking=True)
            dt.copy_(host_dt, non_blocking=True)

    def stage_out():
        if host_out is not None:
            host_out.copy_(out, non_blocking=True)

    def eager_step():
        stage_in()
        compute()
        stage_out()

    timer = time_cuda if cuda else time_cpu
    base = {"config": args.config_name, "B": None, "T": 1, "mode": mode, "what": "stream", "streams": streams,
            "gflop": 2 * streams * sum(p.numel() for p in model.parameters()) / 1e9, "chunk": None,
            "stage_inputs": bool(args.stage_inputs)}
    rows = []
    r = timer(eager_step, args.iters_eager, args.warmup)
    if cuda and args.count_kernels:
        r["kernels"] = count_kernels(compute)
    rows.append({**base, "impl": "eager", **r})
    if cuda and not args.no_graph:
        graph, _ = capture_after_warmup(compute, compute)

        def graph_step():
            stage_in()
            graph.replay()
            stage_out()

        r = timer(graph_step, args.iters, args.warmup)
        if not torch.isfinite(out).all().item():
            raise RuntimeError(f"{args.config_name} stream {streams}: non-finite logits after replay")
        rows.append({**base, "impl": "graph", **r})
        del graph
    return rows


def print_table(rows: list) -> None:
    print()
    hdr = (f"{'config':<7} {'what':<7} {'shape':<14} {'mode':<5} {'impl':<6} {'median µs':>11} {'p10':>9} "
           f"{'p90':>9} {'wall µs':>10} {'GFLOP':>8} {'TFLOP/s':>8} {'kernels':>8}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        shape = f"B={r['B']} T={r['T']}" if r["what"] == "train" else f"S={r['streams']}"
        tflops = r["gflop"] / (r["median_us"] * 1e-6) / 1e3 if r["median_us"] > 0 else float("nan")
        k = r.get("kernels", "")
        print(f"{r['config']:<7} {r['what']:<7} {shape:<14} {r['mode']:<5} {r['impl']:<6} {r['median_us']:>11.1f} "
              f"{r['p10_us']:>9.1f} {r['p90_us']:>9.1f} {r['wall_us']:>10.1f} {r['gflop']:>8.3f} {tflops:>8.2f} "
              f"{k!s:>8}")
    # Speedups of the graph over eager, per (config, what, shape, mode).
    print()
    key = lambda r: (r["config"], r["what"], r["B"], r["T"], r["streams"], r["mode"])  # noqa: E731
    eager = {key(r): r for r in rows if r["impl"] == "eager"}
    for r in rows:
        if r["impl"] == "graph" and key(r) in eager:
            e = eager[key(r)]
            shape = f"B={r['B']} T={r['T']}" if r["what"] == "train" else f"S={r['streams']}"
            print(f"  {r['config']} {r['what']} {shape} {r['mode']}: graph {r['median_us']:.1f} µs vs eager "
                  f"{e['median_us']:.1f} µs, ×{e['median_us'] / r['median_us']:.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--configs", default=None, help="comma list of tiny,small,large (default: all; cpu: tiny)")
    ap.add_argument("--batch", type=int, default=0, help="override B (default: the config's)")
    ap.add_argument("--window", type=int, default=0, help="override T (default: the config's)")
    ap.add_argument("--modes", default=None, help="fp32,tf32 (cpu: fp32)")
    ap.add_argument("--streams", default=None, help="stream counts for the step path (default 1,1024; cpu: 1,16)")
    ap.add_argument("--iters", type=int, default=None, help="timed replays (default 200; cpu 5)")
    ap.add_argument("--iters-eager", type=int, default=None, help="timed eager steps (default 50; cpu 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed iterations first (default 10; cpu 1)")
    ap.add_argument("--chunk", type=int, default=64, help="SSD chunk length")
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--no-graph", action="store_true", help="eager only")
    ap.add_argument("--no-stream", action="store_true", help="skip the step-path benchmark")
    ap.add_argument("--stage-inputs", action="store_true", help="copy inputs from pinned host memory every step")
    ap.add_argument("--count-kernels", action=argparse.BooleanOptionalAction, default=True,
                    help="profile one eager step to count its CUDA kernels (cuda only)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    cpu = args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        print("bench_peer: no CUDA device; use --device cpu for the smoke mode", file=sys.stderr)
        return 2
    configs = (args.configs or ("tiny" if cpu else "tiny,small,large")).split(",")
    modes = (args.modes or ("fp32" if cpu else "fp32,tf32")).split(",")
    streams = [int(s) for s in (args.streams or ("1,16" if cpu else "1,1024")).split(",")]
    args.iters = args.iters or (5 if cpu else 200)
    args.iters_eager = args.iters_eager or (3 if cpu else 50)
    args.warmup = args.warmup if args.warmup is not None else (1 if cpu else 10)
    device = torch.device(args.device)
    if cpu:
        args.no_graph = True  # CUDA graphs are CUDA's

    env = {"torch": torch.__version__, "python": platform.python_version(), "device": args.device,
           "gpu": torch.cuda.get_device_name() if not cpu else platform.processor() or platform.machine(),
           "cuda": torch.version.cuda, "threads": torch.get_num_threads()}
    print(f"bench_peer: {env}", flush=True)
    rows = []
    for name in configs:
        cfg = ref.named_config(name)
        B = args.batch or cfg.batch
        T = args.window or cfg.window
        args.config_name = name
        for mode in modes:
            print(f"  {name} train B={B} T={T} {mode} ...", flush=True)
            rows += bench_train(cfg, B, T, device, mode, args)
            if not args.no_stream:
                for s in streams:
                    print(f"  {name} stream S={s} {mode} ...", flush=True)
                    rows += bench_stream(cfg, s, device, mode, args)
            if not cpu:
                torch.cuda.empty_cache()
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": rows}, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
