"""`python -m mpitrain bench step --data FILE`: training steps fed by the loader.

One process, no all-reduce. In the same run, the network takes `steps` training
steps (after `warmup`) on one random batch, as `bench step` times them, then as
many on the batches the Loader gives from FILE as `train` reads it (training
mode: random-resized-crop, flip, normalise at --image-size; --workers threads,
two batches prefetched; on a GPU into pinned memory, copied to the device in the
step, or, with decode="gpu", decoded and augmented on the GPU as `train --decode
gpu` does). With graph, both take their forward and backward from CUDA graphs, as
`bench step --cuda-graph` does. A fed step's time runs from asking for its batch to the end of its
update, so whatever the loader did not hide is in it; the wait for the batch is
also reported on its own. The ratio fed / random says what the data costs the
step. The figures: docs/benchmarks.md.
"""
import json
import sys

from .step import OneStep, _clock, _median, new_model, random_batch, time_ours, under_mpirun


class DataStepError(ValueError):
    """bench step --data cannot run as asked; the message names the fix."""


def bench_step_data(path, model_name, image_size=224, batch=32, steps=10, warmup=2, workers=2,
                    seed=0, device="cpu", precision="fp32", decode="cpu", graph=False):
    """Time training steps of `model_name` (with the file's classes) on a random batch and
    on the loader's batches from `path`; returns a dict (see the module docstring)."""
    from mpitrain import backend
    from mpitrain.datasets.h5format import FormatError, Reader
    from mpitrain.datasets.loader import Loader, pinned_for
    backend.use_device(device)
    try:
        with Reader(path) as reader:
            classes, records = len(reader.class_names), len(reader)
    except FormatError as e:
        raise DataStepError(str(e)) from None
    if records < batch:
        raise DataStepError(f"{path} holds {records} records, fewer than one batch of {batch}: "
                            f"lower --batch")
    model = new_model(model_name, classes, seed, precision)
    xp = backend.xp
    x, y = random_batch(model, batch, image_size, classes, seed)
    random = time_ours(model, xp.asarray(x), xp.asarray(y), steps, warmup, precision,
                       gflops=False, graph=graph)
    step = OneStep(model, precision, graph=graph)
    seconds, waits, images = [], [], 0
    with Loader(path, batch, train=True, image_size=image_size, workers=workers, prefetch=2,
                dtype=model.dtype, seed=seed, pinned=pinned_for(xp, decode),
                decode=decode) as loader:
        batches = _forever(loader)
        for i in range(warmup + steps):
            start = _clock()
            x, y = next(batches)
            step.forward(xp.asarray(x), xp.asarray(y))
            step.backward()
            step.update()
            if i >= warmup:
                seconds.append(_clock() - start)
                waits.append(loader.last_wait)
                images += len(y)
    fed = {"images_per_s": batch / _median(seconds), "step_ms": 1e3 * _median(seconds),
           "wait_ms": 1e3 * _median(waits), "wait_share": sum(waits) / sum(seconds),
           "images": images}
    if graph:
        fed["cuda_graph"] = step.graph_outcome()
    return {"model": model_name, "file": path, "records": records, "classes": classes,
            "image_size": image_size, "batch": batch, "steps": steps, "warmup": warmup,
            "workers": workers, "device": backend.device, "precision": precision,
            "decode": decode,
            "random": {k: random[k] for k in ("images_per_s", "step_ms", "cuda_graph")
                       if k in random}, "fed": fed,
            "ratio": fed["images_per_s"] / random["images_per_s"]}


def _forever(loader):
    while True:
        yield from loader


def format_result(r):
    f, q = r["fed"], r["random"]
    graph = f" (CUDA graphs: {f['cuda_graph']})" if "cuda_graph" in f else ""
    decoder = ("on the GPU (--decode gpu)" if r["decode"] == "gpu" else
               f"by {r['workers']} loader worker(s)")
    return "\n".join([
        f"bench step --data {r['file']} ({r['records']} records, {r['classes']} classes): "
        f"{r['model']} at {r['image_size']}x{r['image_size']}, batch {r['batch']}, median of "
        f"{r['steps']} steps after {r['warmup']} warm-up (one process, no all-reduce), "
        f"{r['device']}, {r['precision']}{graph}",
        f"  random batch  {q['images_per_s']:8.1f} images/s, step {q['step_ms']:.1f} ms",
        f"  loader-fed    {f['images_per_s']:8.1f} images/s, step {f['step_ms']:.1f} ms "
        f"(decoded {decoder}; waiting for the batch {f['wait_ms']:.1f} ms median, "
        f"{f['wait_share']:.0%} of the steps' time)",
        f"  ratio fed / random: {r['ratio']:.2f}x images/s"])


def main(args):
    """The `bench step --data FILE` command: parse result of cli.build_parser."""
    from mpitrain.backend import DeviceError
    from mpitrain.launcher import launched_rank
    try:
        given = [name for name, value in (("--reference", args.reference),
                                          ("--profile", args.profile),
                                          ("--rounds", args.rounds > 1),
                                          ("--native-openblas", args.native_openblas)) if value]
        if args.decode == "gpu" and args.device != "gpu":
            raise DataStepError("--decode gpu decodes on the GPU the steps run on: add "
                                "--device gpu, or drop --decode gpu")
        if given:
            raise DataStepError(f"{', '.join(given)} cannot be used with --data (they time "
                                f"bench step on random data): drop "
                                f"{'them' if len(given) > 1 else 'it'}, or drop --data")
        if under_mpirun():
            from mpi4py import MPI
            if MPI.COMM_WORLD.size > 1:
                raise DataStepError("bench step --data times one process: run it without "
                                    "mpirun (train reports data wait under mpirun)")
        result = bench_step_data(args.data, args.model, args.image_size, args.batch,
                                 args.steps, args.warmup, args.workers, args.seed, args.device,
                                 args.precision, args.decode, args.cuda_graph)
    except (DataStepError, DeviceError) as e:       # every rank alike: rank 0 says it
        if launched_rank() == 0:
            sys.stderr.write(f"python -m mpitrain bench step: error: {e}\n")
        sys.exit(2)
    print(json.dumps(result) if args.json else format_result(result))
