#!/usr/bin/env python3
"""Writes the golden that tests/golden_test.cc checks the engine's CPU reference against in CI (no torch there).

    make_golden.py --dump-bin build/bin/reference_dump --out tests/data/golden/tiny   # runs reference_dump itself
    make_golden.py --dump-dir DIR --out tests/data/golden/tiny                         # an existing dump of
                                                                                       #   --config tiny --batch 3
    make_golden.py --dump-bin build/bin/reference_dump --max-norm 0.25 --out tests/data/golden/tiny_clipped
                                                     # the steps' clipping engaged (tiny's norms are 0.21-0.39)

The PyTorch reference (perception_ref.py) runs in float64 on the dump's checkpoint and batch exactly as
compare.py runs it (compare.torch_run: the checkpoint loaded with the reference's loader, SSD chunk T//3+1,
torch.optim.AdamW with §4's decay groups, clip_grad_norm_). Written into --out:
  init.safetensors    the dump's checkpoint (the parameters, float32), copied as is;
  golden.safetensors  batch.{x,dt,labels,mask} (float32, as in dump.safetensors) and the torch float64 results
                      under `torch64.`: logits [B,T,H], loss [1], dx [B,T,F], grad.<name> (every trained tensor),
                      train.loss [S] and train.grad_norm [S] (per step, the loss before it and the pre-clip norm),
                      step<S>.<name> (the parameters after the S clip+AdamW steps).
                      A float64 value v is stored as two F32 tensors, `<key>` = float(v) and
                      `<key>@lo` = float(v − float(v)) (the engine reads F32 only; this is reference_dump's
                      encoding), which recovers v to ~2^-48 relative.
                      Metadata: format, encoding, config (JSON), config_name, seeds, steps, lr, max_norm,
                      weight_decay, beta1, beta2, eps, chunk, torch_version.
Exit status: 0 written, 1 a failure, 77 when torch or safetensors cannot be imported.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))
FORMAT = "perception-golden-v1"
ENCODING = "float64 v as F32 <key> = float(v) and F32 <key>@lo = float(v - float(v))"
DUMP_ARGS = ["--config", "tiny", "--batch", "3", "--float32", "off"]  # default seeds, steps and lr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--dump-bin", help=f"run this reference_dump ({' '.join(DUMP_ARGS)}) into a temporary folder")
    src.add_argument("--dump-dir", help="an existing reference_dump output folder (--config tiny --batch 3)")
    ap.add_argument("--out", required=True, help="the golden folder (tests/data/golden/tiny)")
    ap.add_argument("--max-norm", help="reference_dump's --max-norm with --dump-bin (its default: 1.0)")
    args = ap.parse_args()
    if args.max_norm is not None and args.dump_dir:
        ap.error("--max-norm applies to --dump-bin's run; a --dump-dir dump has its own (its metadata's max_norm)")

    try:
        import torch
        from safetensors.torch import save_file
    except ImportError as e:  # CI has no torch: say why and skip
        print(f"SKIP: make_golden.py needs python3 with torch and safetensors ({e}); "
              f"pip install torch safetensors numpy", flush=True)
        return SKIP
    sys.path.insert(0, HERE)
    import compare  # noqa: E402  (exits 77 itself when torch cannot be imported)

    with tempfile.TemporaryDirectory(prefix="perception_golden_") as tmp:
        dump_dir = args.dump_dir
        if args.dump_bin:
            dump_dir = tmp
            cmd = [args.dump_bin, "--out", dump_dir] + DUMP_ARGS
            if args.max_norm is not None:
                cmd += ["--max-norm", args.max_norm]
            print("$ " + " ".join(cmd), flush=True)
            if subprocess.run(cmd).returncode != 0:
                print("make_golden.py: reference_dump failed", flush=True)
                return 1
        return write_golden(torch, save_file, compare, dump_dir, args.out)


def write_golden(torch, save_file, compare, dump_dir: str, out: str) -> int:
    ref = compare.ref
    torch.manual_seed(0)  # as compare.py
    d = compare.DumpFile(os.path.join(dump_dir, "dump.safetensors"))
    cfg = ref.ModelConfig.from_json(d.meta["config"])
    chunk = max(1, cfg.window // 3 + 1)  # compare.py's default
    steps = int(d.meta["steps"])
    shape = tuple(d.t["batch.x"].shape)
    print(f"config {d.meta.get('config_name')} {d.meta['config']}\nbatch {shape}, SSD chunk {chunk}, "
          f"torch {torch.__version__}, float64, {steps} steps lr {d.meta['lr']} max_norm {d.meta['max_norm']} "
          f"weight_decay {d.meta['weight_decay']}", flush=True)
    if d.meta.get("config_name") != "tiny" or shape[0] != 3:
        print(f"make_golden.py: note: the committed golden is tiny at B=3; this dump is "
              f"{d.meta.get('config_name')} at B={shape[0]}", flush=True)

    run, opt = compare.torch_run(d, dump_dir, chunk, "float64")

    results = {"logits": run["logits"], "loss": run["loss"], "dx": run["dx"],
               "train.loss": run["train.loss"], "train.grad_norm": run["train.grad_norm"]}
    for n, g in run["grad"].items():
        results["grad." + n] = g
    for n, p in run["params"].items():
        results[f"step{steps}." + n] = p

    tensors = {k: d.t[k].to(torch.float32).contiguous().clone() for k in
               ("batch.x", "batch.dt", "batch.labels", "batch.mask")}
    worst_encoding = 0.0
    for key, v in results.items():
        v = v.detach().to(device="cpu")
        if v.dtype != torch.float64:
            print(f"make_golden.py: {key} is {v.dtype}, not float64", flush=True)
            return 1
        if not torch.isfinite(v).all():
            print(f"make_golden.py: {key} is not finite", flush=True)
            return 1
        hi = v.to(torch.float32)
        lo = (v - hi.to(torch.float64)).to(torch.float32)
        back = hi.to(torch.float64) + lo.to(torch.float64)
        worst_encoding = max(worst_encoding, compare.rel_err(back, v))
        tensors["torch64." + key] = hi.contiguous().clone()
        tensors["torch64." + key + "@lo"] = lo.contiguous().clone()
    if worst_encoding > 1e-13:
        print(f"make_golden.py: the hi+lo encoding loses {worst_encoding:.3e} relative", flush=True)
        return 1

    group = opt.param_groups[0]
    metadata = {
        "format": FORMAT,
        "encoding": ENCODING,
        "config": d.meta["config"],
        "config_name": d.meta.get("config_name", ""),
        "param_seed": d.meta["param_seed"],
        "batch_seed": d.meta["batch_seed"],
        "state_seed": d.meta["state_seed"],
        "steps": d.meta["steps"],
        "lr": d.meta["lr"],
        "max_norm": d.meta["max_norm"],
        "weight_decay": d.meta["weight_decay"],
        "beta1": repr(float(group["betas"][0])),
        "beta2": repr(float(group["betas"][1])),
        "eps": repr(float(group["eps"])),
        "chunk": str(chunk),
        "dtype": "float64",
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "dump_format": d.meta.get("format", ""),
        "generator": "tests/reference/make_golden.py",
    }

    # The engine's float64 run in the same dump, at the float64 bar: what golden_test will find (informational; the
    # golden is PyTorch's, whatever the engine computes).
    worst = ("", 0.0)
    for key in results:
        err = compare.rel_err(results[key], d(f"cpu64.{key}"))
        if err > worst[1] or not worst[0]:
            worst = (key, err)
    status = "ok" if worst[1] <= compare.BAR_F64 else "ABOVE THE BAR: golden_test will fail"
    print(f"engine cpu64 vs torch64: worst {worst[1]:.3e} ({worst[0]}), bar {compare.BAR_F64:.0e}: {status}",
          flush=True)

    os.makedirs(out, exist_ok=True)
    shutil.copyfile(os.path.join(dump_dir, "init.safetensors"), os.path.join(out, "init.safetensors"))
    save_file(tensors, os.path.join(out, "golden.safetensors"), metadata=metadata)
    print(f"wrote {os.path.join(out, 'init.safetensors')} and {os.path.join(out, 'golden.safetensors')} "
          f"({len(results)} float64 tensors, loss {results['loss'].item():.17g})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
