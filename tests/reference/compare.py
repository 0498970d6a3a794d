#!/usr/bin/env python3
"""Checks our engine against the independent PyTorch reference (perception_ref.py), MODEL.md §8.

    compare.py --dir DIR                                  # compare an existing reference_dump output
    compare.py --dump-bin build/bin/reference_dump --dir DIR -- --config tiny [dumper flags]

What is compared (relative error ‖a−b‖/‖b‖ per tensor; a NaN or Inf never passes):
  * PyTorch float64 and float32 (autograd), run on the checkpoint `init.safetensors` loaded with the
    reference's checkpoint loader, against the engine's float64 run (`cpu64`): logits, loss, every
    gradient, dx, the per-step losses and gradient norms and the parameters after S clip+AdamW steps
    (torch.optim.AdamW, §4 decay groups, clip_grad_norm_), the sequence path from random carried
    states (logits and final states) and the step path over one stream.
  * The engine's float32 run (`cpu32`) against PyTorch float64: MODEL.md §8 proper for our engine.
  * Resuming: `stepK.safetensors` (parameters, AdamW moments and step) loaded into torch.optim.AdamW and
    trained to step S equals the engine's S-step parameters.
  * Inside the reference: the chunked SSD form against the sequential scan (outputs, final states and
    gradients, several chunk lengths), and the step path against the sequence path (from zero and
    from a carried state).
Bars: float32 vs float64, MODEL.md §8: logits, loss and states 1e-5; gradients, dx and parameters after
the steps 1e-4. float64 vs float64 (the same math in two implementations): 1e-9 (observed ~1e-14); the
resumed run 1e-4 (the checkpoint is float32, so it restarts from values rounded to ~6e-8).
Exit status: 0 all pass, 1 a failure, 77 when torch or safetensors cannot be imported (ctest SKIP).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys

SKIP = 77
try:
    import torch
    import safetensors  # noqa: F401
    from safetensors import safe_open
    from safetensors.torch import load_file
except ImportError as e:  # CI has no torch: skip, saying why
    print(f"SKIP: the PyTorch reference needs python3 with torch and safetensors ({e}); "
          f"pip install torch safetensors numpy", flush=True)
    sys.exit(SKIP)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import perception_ref as ref  # noqa: E402

BAR_F32_VALUES = 1e-5  # logits, loss, states (MODEL.md §8)
BAR_F32_GRADS = 1e-4  # gradients, dx, parameters after the steps (MODEL.md §8)
BAR_F64 = 1e-9  # float64 against float64
BAR_RESUME = 1e-4
# TF32 (10-bit mantissa in matmul inputs, float32 accumulation): products carry ~5e-4 relative rounding, so
# a TF32 run (CUDA only) is held to 1e-2 on values and 3e-2 on gradients and on parameters after the steps.
BAR_TF32_VALUES = 1e-2
BAR_TF32_GRADS = 3e-2

# name: (dtype, tag, allow_tf32, bar on values, bar on gradients/parameters)
PRECISIONS = {
    "float64": (torch.float64, "torch64", False, BAR_F64, BAR_F64),
    "float32": (torch.float32, "torch32", False, BAR_F32_VALUES, BAR_F32_GRADS),
    "tf32": (torch.float32, "torchtf32", True, BAR_TF32_VALUES, BAR_TF32_GRADS),
}
DEVICE = torch.device("cpu")


def use_precision(name: str):
    dtype, tag, tf32, bar_v, bar_g = PRECISIONS[name]
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    return dtype, tag, bar_v, bar_g


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.detach().to(torch.float64).cpu().reshape(-1)
    b = b.detach().to(torch.float64).cpu().reshape(-1)
    if a.shape != b.shape:
        return math.inf
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf  # NaN never passes
    den = b.norm().item()
    num = (a - b).norm().item()
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return num / den


class Report:
    def __init__(self, verbose: bool):
        self.rows = []  # (section, name, err, bar)
        self.verbose = verbose

    def add(self, section: str, name: str, a, b, bar: float) -> float:
        err = rel_err(a, b)
        self.rows.append((section, name, err, bar))
        return err

    def print(self) -> bool:
        ok_all = True
        width = max(len(r[1]) for r in self.rows)
        current = None
        summary = {}
        for section, name, err, bar in self.rows:
            ok = err <= bar
            ok_all &= ok
            s = summary.setdefault(section, [0.0, "", bar, True])  # worst by err/bar
            if s[1] == "" or err / bar > s[0] / s[2]:
                s[0], s[1], s[2] = err, name, bar
            s[3] &= ok
            if self.verbose or not ok:
                if section != current:
                    print(f"\n== {section}")
                    current = section
                print(f"  {name:<{width}}  {err:10.3e}  (bar {bar:.0e})  {'ok' if ok else 'FAIL'}")
        print("\n== summary: worst relative error (against its bar) per comparison")
        swidth = max(len(k) for k in summary)
        for group, (err, name, bar, ok) in summary.items():
            print(f"  {group:<{swidth}}  {err:10.3e}  (bar {bar:.0e})  {'ok  ' if ok else 'FAIL'}  worst: {name}")
        print(f"\n{'PASS' if ok_all else 'FAIL'}: {sum(1 for r in self.rows if r[2] <= r[3])}/{len(self.rows)} "
              f"comparisons within their bars")
        return ok_all


class DumpFile:
    def __init__(self, path: str):
        self.t = load_file(path)
        with safe_open(path, framework="pt") as f:
            self.meta = f.metadata()

    def __call__(self, key: str) -> torch.Tensor:
        """A dumped tensor in float64 (float64 values were stored as hi + lo float32 pairs)."""
        v = self.t[key].to(torch.float64)
        lo = self.t.get(key + "@lo")
        return v + lo.to(torch.float64) if lo is not None else v

    def has(self, key: str) -> bool:
        return key in self.t


def state_from_dump(d: DumpFile, prefix: str, cfg: ref.ModelConfig, dtype) -> ref.State:
    conv, ssm, cfc = (d(prefix + k).to(device=DEVICE, dtype=dtype) for k in ("conv", "ssm", "cfc"))
    return ref.State([conv[:, l] for l in range(cfg.n_layers)], [ssm[:, l] for l in range(cfg.n_layers)], cfc)


def train(model, opt, batch, steps: int, max_norm: float):
    x, dt, y, m = batch
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = ref.masked_bce(model(x, dt), y, m)
        loss.backward()
        norms.append(ref.clip_and_step(model, opt, max_norm))
        losses.append(loss.detach())
    return torch.stack(losses), torch.stack(norms)


def torch_run(d: DumpFile, dirname: str, chunk: int, prec: str):
    """PyTorch in precision `prec` on the dump's checkpoint `init.safetensors` and batch: logits, loss, dx, every
    gradient, the carried-state and step-path outputs, then the dump's S clip+AdamW steps (its steps, lr, max_norm,
    weight_decay): train.loss, train.grad_norm, params. Returns (run, opt): the results by key and the optimizer
    after the steps."""
    cfg = ref.ModelConfig.from_json(d.meta["config"])
    steps = int(d.meta["steps"])
    lr, max_norm, wd = float(d.meta["lr"]), float(d.meta["max_norm"]), float(d.meta["weight_decay"])
    dtype = use_precision(prec)[0]
    model, opt, step0 = ref.load_checkpoint(os.path.join(dirname, "init.safetensors"), dtype=dtype, chunk=chunk,
                                            lr=lr, weight_decay=wd, device=DEVICE)
    assert step0 == 0
    x = d("batch.x").to(device=DEVICE, dtype=dtype).requires_grad_(True)
    dt, y, m = (d("batch." + k).to(device=DEVICE, dtype=dtype) for k in ("dt", "labels", "mask"))
    logits = model(x, dt)
    loss = ref.masked_bce(logits, y, m)
    loss.backward()
    run = {"logits": logits.detach(), "loss": loss.detach().reshape(1), "dx": x.grad.detach(),
           "grad": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}
    with torch.no_grad():
        init = state_from_dump(d, "state.init.", cfg, dtype)
        bs = init.cfc.shape[0]  # the carried-state check covers the first bs streams
        s_logits, s_final = model(x.detach()[:bs], dt[:bs], state=init, return_state=True)
        run["state.logits"] = s_logits
        run["state.final.conv"] = torch.stack(s_final.conv, dim=1)
        run["state.final.ssm"] = torch.stack(s_final.ssm, dim=1)
        run["state.final.cfc"] = s_final.cfc
        st = ref.State([c[:1] for c in init.conv], [s[:1] for s in init.ssm], init.cfc[:1])
        outs = []
        for t in range(cfg.window):
            lg, st = model.step(x.detach()[:1, t], dt[:1, t], st)
            outs.append(lg[0])
        run["stream.logits"] = torch.stack(outs)
    losses, norms = train(model, opt, (x.detach(), dt, y, m), steps, max_norm)
    run["train.loss"], run["train.grad_norm"] = losses, norms
    run["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return run, opt


def compare_engine(rep: Report, d: DumpFile, dirname: str, chunk: int, precisions) -> None:
    cfg = ref.ModelConfig.from_json(d.meta["config"])
    steps, save_step = int(d.meta["steps"]), int(d.meta["save_step"])
    lr, max_norm, wd = float(d.meta["lr"]), float(d.meta["max_norm"]), float(d.meta["weight_decay"])
    L = cfg.n_layers
    torch_runs = {}
    for prec in precisions:
        dtype, tag, _, bar_g = use_precision(prec)
        run, _ = torch_run(d, dirname, chunk, prec)
        x = d("batch.x").to(device=DEVICE, dtype=dtype)
        dt, y, m = (d("batch." + k).to(device=DEVICE, dtype=dtype) for k in ("dt", "labels", "mask"))
        torch_runs[tag] = run

        # Resume from the engine's step-K checkpoint (parameters + AdamW state) and finish the S steps.
        model_r, opt_r, k = ref.load_checkpoint(os.path.join(dirname, f"step{save_step}.safetensors"), dtype=dtype,
                                                chunk=chunk, lr=lr, weight_decay=wd, device=DEVICE)
        assert k == save_step, (k, save_step)
        train(model_r, opt_r, (x.detach(), dt, y, m), steps - k, max_norm)
        for n, p in model_r.named_parameters():
            rep.add(f"resume {tag}: step{k}.safetensors + {steps - k} steps vs cpu64 step{steps}", n, p,
                    d(f"cpu64.step{steps}.{n}"), max(BAR_RESUME, bar_g))

    names = [n for n, _ in ref.PerceptionNet(cfg).named_parameters()]

    def rows(label: str, get, expect_prefix: str, bar_values: float, bar_grads: float, expect=None, keys=None):
        """get(key) gives the tested tensor; expected values from the dump (or `expect`). `keys` limits the rows
        to the keys a run has (a device run has no dx, carried state or step path)."""
        exp = expect or (lambda k: d(f"{expect_prefix}.{k}"))

        def add(section, name, key, bar):
            if keys is None or keys(key):
                rep.add(f"{label}: {section}", name, get(key), exp(key), bar)

        add("logits", "logits", "logits", bar_values)
        add("loss", "loss", "loss", bar_values)
        for n in names:
            add("grads", n, "grad." + n, bar_grads)
        add("dx", "dx", "dx", bar_grads)
        add("train losses", "train.loss", "train.loss", bar_values)
        add("train grad norms", "train.grad_norm", "train.grad_norm", bar_grads)
        for n in names:
            add(f"params after {steps} steps", n, f"step{steps}." + n, bar_grads)
        add("carried state", "state.logits", "state.logits", bar_values)
        for k in ("conv", "ssm", "cfc"):
            add("carried state", f"state.final.{k}", f"state.final.{k}", bar_values)
        add("step path", "stream.logits", "stream.logits", bar_values)

    def torch_get(run):
        def get(key):
            if key.startswith("grad."):
                return run["grad"][key[5:]]
            if key.startswith(f"step{steps}."):
                return run["params"][key[len(f"step{steps}."):]]
            return run[key]
        return get

    runs = d.meta.get("runs", "cpu64,cpu32").split(",")
    if "torch64" in torch_runs:
        rows("torch64 vs cpu64", torch_get(torch_runs["torch64"]), "cpu64", BAR_F64, BAR_F64)
        # MODEL.md §8 for our engine: its float32 runs (CPU reference, CUDA backend) against the independent float64
        # evaluation.
        for run in ("cpu32", "dev32"):
            if run in runs:
                rows(f"{run} vs torch64", lambda k, run=run: d(f"{run}.{k}"), None, BAR_F32_VALUES, BAR_F32_GRADS,
                     expect=torch_get(torch_runs["torch64"]), keys=lambda k, run=run: d.has(f"{run}.{k}"))
    for prec in precisions:
        _, tag, _, bar_v, bar_g = PRECISIONS[prec]
        if tag != "torch64":
            rows(f"{tag} vs cpu64", torch_get(torch_runs[tag]), "cpu64", bar_v, bar_g)


def self_checks(rep: Report, cfg: ref.ModelConfig, precisions, seed: int = 7) -> None:
    """Checks inside the reference: SSD ≡ scan, step ≡ sequence, carried state ≡ concatenation."""
    for prec in precisions:
        dtype, tag, bar_v, bar_g = use_precision(prec)
        tag = {"torch64": "f64", "torch32": "f32", "torchtf32": "tf32"}[tag]
        dev = dict(device=DEVICE, dtype=dtype)
        g = torch.Generator().manual_seed(seed)
        T, b = cfg.window, 3
        Hh, P, N = cfg.n_heads, cfg.headdim, cfg.d_state

        # The SSM alone, with a random initial state, several chunk lengths (multiple of T or not).
        xs = torch.randn(b, T, Hh, P, generator=g, dtype=torch.float64).to(**dev)
        dtv = torch.nn.functional.softplus(torch.randn(b, T, Hh, generator=g, dtype=torch.float64) - 1).to(**dev)
        A = -torch.exp(torch.rand(Hh, generator=g, dtype=torch.float64) * math.log(16)).to(**dev)
        Bm = torch.randn(b, T, N, generator=g, dtype=torch.float64).to(**dev)
        Cm = torch.randn(b, T, N, generator=g, dtype=torch.float64).to(**dev)
        s0 = torch.randn(b, Hh, P, N, generator=g, dtype=torch.float64).to(**dev)
        y_ref, s_ref = ref.ssm_scan(xs, dtv, A, Bm, Cm, s0)
        for q in sorted({1, 2, max(1, T // 3 + 1), T, 64}):
            y, s = ref.ssd_chunked(xs, dtv, A, Bm, Cm, q, s0)
            rep.add(f"SSD vs scan ({tag})", f"ssm y, chunk {q}", y, y_ref, bar_v)
            rep.add(f"SSD vs scan ({tag})", f"ssm final state, chunk {q}", s, s_ref, bar_v)

        # The whole model and its gradients: SSD (two chunk lengths) against the scan.
        model = ref.PerceptionNet(cfg, chunk=max(1, T // 3 + 1))
        model.init_parameters(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.empty_like(p).uniform_(-0.2, 0.2, generator=g))
            model.norm.mean.uniform_(-0.5, 0.5, generator=g)
            model.norm.inv_std.uniform_(0.5, 2.0, generator=g)
            for layer in model.layers:  # dt ~ 1, so that the SSM's recurrence carries weight in the output
                layer.mixer.dt_bias.add_(3.0)
        model.to(**dev)
        u = (torch.rand(b, T, cfg.n_features, generator=g, dtype=torch.float64) * 4 - 2).to(**dev)
        dts = (torch.rand(b, T, generator=g, dtype=torch.float64) * 2).to(**dev)
        y = (torch.rand(b, T, cfg.n_horizons, generator=g) < 0.5).to(**dev)
        m = (torch.rand(b, T, cfg.n_horizons, generator=g) < 0.8).to(**dev)

        def loss_and_grads(scan: bool, chunk: int):
            model.set_chunk(chunk)
            model.zero_grad(set_to_none=True)
            logits = model(u, dts, scan=scan)
            ref.masked_bce(logits, y, m).backward()
            return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

        l_scan, g_scan = loss_and_grads(True, 1)
        for q in sorted({max(1, T // 3 + 1), 64}):
            l_ssd, g_ssd = loss_and_grads(False, q)
            rep.add(f"SSD vs scan ({tag})", f"model logits, chunk {q}", l_ssd, l_scan, bar_v)
            worst = max(g_ssd, key=lambda n: rel_err(g_ssd[n], g_scan[n]))
            rep.add(f"SSD vs scan ({tag})", f"model grads, chunk {q} (worst: {worst})", g_ssd[worst], g_scan[worst],
                    bar_g)

        with torch.no_grad():
            model.set_chunk(max(1, T // 3 + 1))
            full, final = model(u, dts, return_state=True)
            # Step path from zero ≡ the sequence path at every position.
            st = ref.State.zeros(cfg, b, **dev)
            steps = []
            for t in range(T):
                lg, st = model.step(u[:, t], dts[:, t], st)
                steps.append(lg)
            rep.add(f"step vs sequence ({tag})", "step from zero, all positions", torch.stack(steps, 1), full, bar_v)
            for name, a, bb in (("conv", st.conv, final.conv), ("ssm", st.ssm, final.ssm)):
                rep.add(f"step vs sequence ({tag})", f"final {name} state", torch.cat(a), torch.cat(bb), bar_v)
            rep.add(f"step vs sequence ({tag})", "final cfc state", st.cfc, final.cfc, bar_v)
            st_in = ref.State.zeros(cfg, b, **dev)  # the in-place step (what the served path and graphs use)
            steps_in = [model.step(u[:, t], dts[:, t], st_in, inplace=True)[0] for t in range(T)]
            rep.add(f"step vs sequence ({tag})", "in-place step from zero, all positions", torch.stack(steps_in, 1),
                    full, bar_v)
            rep.add(f"step vs sequence ({tag})", "in-place final ssm state", torch.cat(st_in.ssm), torch.cat(final.ssm),
                    bar_v)
            # Sequence over the first part, carry, then sequence (or steps) over the rest ≡ the whole.
            k = max(1, T // 2 - 1)
            first, carried = model(u[:, :k], dts[:, :k], return_state=True)
            second = model(u[:, k:], dts[:, k:], state=carried)
            rep.add(f"step vs sequence ({tag})", f"carry after {k}, sequence", torch.cat([first, second], 1), full,
                    bar_v)
            st = carried
            rest = []
            for t in range(k, T):
                lg, st = model.step(u[:, t], dts[:, t], st)
                rest.append(lg)
            rep.add(f"step vs sequence ({tag})", f"carry after {k}, steps", torch.stack(rest, 1), full[:, k:], bar_v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="reference_dump output folder")
    ap.add_argument("--dump-bin", help="run this reference_dump first (flags after --)")
    ap.add_argument("--chunk", type=int, default=0, help="SSD chunk length (0: T//3+1, so chunks pad)")
    ap.add_argument("--precisions", default="float64,float32", help="float64, float32 and/or tf32 (CUDA)")
    ap.add_argument("--device", default="cpu", help="where the PyTorch reference runs (cpu, cuda)")
    ap.add_argument("--quiet", action="store_true", help="print failures and the summary only")
    ap.add_argument("dump_args", nargs="*", help="flags for reference_dump (after --)")
    args = ap.parse_args()

    if args.dump_bin:
        cmd = [args.dump_bin, "--out", args.dir] + args.dump_args
        print("$ " + " ".join(cmd), flush=True)
        dumped = subprocess.run(cmd)
        if dumped.returncode == SKIP:  # e.g. --device cuda on a machine without a CUDA device
            print("SKIP: reference_dump skipped (its reason is above)", flush=True)
            return SKIP
        if dumped.returncode != 0:
            print(f"reference_dump failed with exit code {dumped.returncode}", flush=True)
            return 1
    torch.manual_seed(0)
    precisions = args.precisions.split(",")
    for p in precisions:
        if p not in PRECISIONS:
            ap.error(f"unknown precision {p} (float64, float32, tf32)")
    global DEVICE
    DEVICE = torch.device(args.device)
    d = DumpFile(os.path.join(args.dir, "dump.safetensors"))
    cfg = ref.ModelConfig.from_json(d.meta["config"])
    chunk = args.chunk or max(1, cfg.window // 3 + 1)
    print(f"config {d.meta.get('config_name')} {d.meta['config']}\nSSD chunk {chunk}, torch {torch.__version__} on {DEVICE}, "
          f"{d.meta['steps']} steps lr {d.meta['lr']} max_norm {d.meta['max_norm']}", flush=True)
    rep = Report(verbose=not args.quiet)
    compare_engine(rep, d, args.dir, chunk, precisions)
    self_checks(rep, cfg, precisions)
    return 0 if rep.print() else 1


if __name__ == "__main__":
    sys.exit(main())
