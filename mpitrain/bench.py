"""`python -m mpitrain bench step`: how fast one training step runs, against PyTorch.

One process, random data, no all-reduce: the step is forward + loss, backward
and the SGD update, each timed separately (median over the timed steps, after
untimed warm-up steps). With `--reference torch` the same network with the same
weights (mpitrain.reference_torch) takes the same batch through the same step
with torch.optim.SGD, in the same run, with torch's thread count matched to
NumPy's BLAS; the ratio ours / torch is what to quote.

OpenBLAS reads OPENBLAS_CORETYPE when it loads. Where a machine forces an older
core type, `--native-openblas` re-runs the command without it (and without
OPENBLAS_L2_SIZE) and says so.
"""
import json
import os
import sys
import time

OPENBLAS_FORCING = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
REEXEC_MARK = "MPITRAIN_NATIVE_OPENBLAS"     # set in the re-run: what was removed


def blas_info():
    """The BLAS NumPy runs on: library, version, core type, threads (threadpoolctl, if installed)."""
    info = {"forced": {k: os.environ[k] for k in OPENBLAS_FORCING if k in os.environ}}
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return {**info, "library": "unknown (install threadpoolctl)", "threads": os.cpu_count()}
    for lib in threadpool_info():
        if lib["user_api"] == "blas":
            return {**info, "library": lib["internal_api"], "version": lib.get("version"),
                    "core_type": lib.get("architecture"), "threads": lib["num_threads"]}
    return {**info, "library": "none found", "threads": os.cpu_count()}


def _median(values):
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])


def _summary(batch, phases):
    """phases: name -> per-step seconds. Medians in ms, and images/s from the median step."""
    step = _median([sum(t) for t in zip(*phases.values())])
    return {"images_per_s": batch / step, "step_ms": 1e3 * step,
            **{f"{name}_ms": 1e3 * _median(t) for name, t in phases.items()}}


def time_ours(model, x, y, steps, warmup, lr=0.01, momentum=0.9, weight_decay=1e-4):
    from mpitrain import backend
    from mpitrain.nets.losses import softmax_cross_entropy
    from mpitrain.optim import SGD
    optimizer = SGD(model.arena, momentum=momentum, weight_decay=weight_decay)
    phases = {"forward_loss": [], "backward": [], "update": []}
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        logits = model.forward(x, train=True)
        _, dlogits = softmax_cross_entropy(logits, y)
        backend.synchronize()
        t1 = time.perf_counter()
        model.backward(dlogits)
        backend.synchronize()
        t2 = time.perf_counter()
        optimizer.step(lr)
        backend.synchronize()
        t3 = time.perf_counter()
        if i >= warmup:
            for name, t in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                phases[name].append(t)
    return _summary(len(y), phases)


def time_torch(model, x, y, steps, warmup, threads, lr=0.01, momentum=0.9, weight_decay=1e-4):
    import torch
    from mpitrain.reference_torch import input_to_torch, to_torch
    torch.set_num_threads(threads)
    tmodel = to_torch(model).train()
    tx, ty = input_to_torch(x), torch.from_numpy(y)
    optimizer = torch.optim.SGD(tmodel.parameters(), lr=lr, momentum=momentum,
                                weight_decay=weight_decay)
    loss_fn = torch.nn.CrossEntropyLoss()
    phases = {"forward_loss": [], "backward": [], "update": []}
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(tmodel(tx), ty)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        if i >= warmup:
            for name, t in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                phases[name].append(t)
    return {"version": torch.__version__, "threads": torch.get_num_threads(),
            **_summary(len(y), phases)}


def bench_step(model_name, image_size=64, batch=32, steps=10, warmup=2, num_classes=1000,
               seed=0, reference=None):
    """Time training steps of `model_name` on a random batch; returns a dict (see main_step)."""
    import numpy as np
    from mpitrain.nets import build_model
    model = build_model(model_name, num_classes=num_classes, seed=seed)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, image_size, image_size, 3)).astype(model.dtype)
    y = rng.integers(0, num_classes, batch)
    result = {"model": model_name, "image_size": image_size, "batch": batch, "steps": steps,
              "warmup": warmup, "blas": blas_info()}
    result["mpitrain"] = time_ours(model, x, y, steps, warmup)
    if reference == "torch":
        # torch is imported only now, so that it cannot disturb our timings; the same
        # seed rebuilds the same starting weights
        fresh = build_model(model_name, num_classes=num_classes, seed=seed)
        result["torch"] = time_torch(fresh, x, y, steps, warmup, result["blas"]["threads"])
        result["ratio"] = result["mpitrain"]["images_per_s"] / result["torch"]["images_per_s"]
    return result


def _reexec_without_openblas_forcing(argv, to_stderr):
    """Replace this process by the same command with OPENBLAS_CORETYPE/_L2_SIZE unset
    (they must be gone before NumPy loads OpenBLAS, hence a fresh process)."""
    removed = {k: os.environ[k] for k in OPENBLAS_FORCING if k in os.environ}
    env = {k: v for k, v in os.environ.items() if k not in OPENBLAS_FORCING}
    env[REEXEC_MARK] = " ".join(f"{k}={v}" for k, v in removed.items())
    print(f"--native-openblas: re-running without "
          f"{', '.join(f'{k}={v}' for k, v in removed.items())}",
          file=sys.stderr if to_stderr else sys.stdout, flush=True)
    os.execve(sys.executable, [sys.executable, "-m", "mpitrain", *argv], env)


def main_step(args, argv):
    """The `bench step` command: parse result of cli.build_parser, and the raw argv (for the re-run)."""
    if args.native_openblas and REEXEC_MARK not in os.environ \
            and any(k in os.environ for k in OPENBLAS_FORCING):
        _reexec_without_openblas_forcing(argv, to_stderr=args.json)
    result = bench_step(args.model, args.image_size, args.batch, args.steps, args.warmup,
                        args.num_classes, args.seed, args.reference)
    if args.native_openblas:
        result["native_openblas"] = {"removed": os.environ.get(REEXEC_MARK) or "nothing was set"}
    if args.json:
        print(json.dumps(result))
        return
    print(format_result(result))


def format_result(r):
    b = r["blas"]
    forced = ", ".join(f"{k}={v}" for k, v in b["forced"].items()) or "none"
    lines = [f"bench step: {r['model']} at {r['image_size']}x{r['image_size']}, batch {r['batch']}, "
             f"median of {r['steps']} steps after {r['warmup']} warm-up (one process, no all-reduce)",
             f"NumPy BLAS: {b['library']} {b.get('version') or ''} core type "
             f"{b.get('core_type') or '?'}, {b['threads']} threads; forced by environment: {forced}"]
    if "native_openblas" in r:
        lines.append(f"--native-openblas: removed from the environment: "
                     f"{r['native_openblas']['removed']}")
    for name in ("mpitrain", "torch"):
        if name in r:
            t = r[name]
            label = f"torch {t['version']} ({t['threads']} threads)" if name == "torch" else name
            lines.append(f"{label}: {t['images_per_s']:.1f} images/s, step {t['step_ms']:.1f} ms "
                         f"(forward+loss {t['forward_loss_ms']:.1f}, backward "
                         f"{t['backward_ms']:.1f}, update {t['update_ms']:.1f})")
    if "ratio" in r:
        lines.append(f"ratio mpitrain / torch: {r['ratio']:.2f}x images/s")
    return "\n".join(lines)
