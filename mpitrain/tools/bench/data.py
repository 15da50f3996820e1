"""`python -m mpitrain bench data`: images/s of read + decode + augment.

Measures mpitrain's Loader on an encoded (JPEG) file in training mode
(random-resized-crop, flip, normalise into NHWC float32). With
reference="torch", the same records of the same file go, in the same run,
through a PyTorch DataLoader with the same number of worker processes and the
classic PIL pipeline written out here (decode, RandomResizedCrop as
torchvision draws it, flip, ToTensor, Normalize, default collate), and the
ratio is reported. With device="gpu", the Loader decodes and augments on the GPU
(--decode gpu: nvImageCodec, then one kernel per chunk of a batch, into fp16 on the
device), and the CPU loader with a worker on every core this process may run on is
timed beside it. The first batch of each is left out of the timing (worker start-up).
The figures: docs/benchmarks.md.
"""
import glob
import io
import json
import os
import time

import numpy as np
from PIL import Image

from mpitrain.datasets.augment import random_resized_crop_box, simplejpeg
from mpitrain.datasets.h5format import Reader
from mpitrain.datasets.loader import Loader
from mpitrain.launcher import cores

from .step import _median


def _children():
    """Process ids of this process's children (Linux /proc; empty elsewhere)."""
    pids = []
    for task in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with open(task) as fh:
            pids += [int(p) for p in fh.read().split()]
    return pids


def _cpu_seconds():
    """CPU time of this process (all threads) and of its children so far."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK")
    for pid in _children():
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick     # utime + stime
        except OSError:
            pass
    return total


def _time_batches(batches, count, finish=lambda: None):
    """Wall seconds, CPU seconds and images of `count` batches after the first one;
    `finish` waits for the last batch's work (a device's queue) before the clock stops.

    CPU seconds (this process and its worker processes) make a measure that
    holds on a machine shared with other work: images per CPU-second."""
    it = iter(batches)
    next(it)
    images = 0
    cpu, start = _cpu_seconds(), time.perf_counter()
    for _ in range(count):
        x, y = next(it)
        images += len(y)
    finish()
    return time.perf_counter() - start, _cpu_seconds() - cpu, images


def _forever(loader):
    while True:
        yield from loader


def bench_mpitrain(path, workers, batch, image_size, count, decode="cpu"):
    """The Loader's training batches: float32 on the host, or (decode="gpu") fp16 on the
    GPU, as --precision fp16 trains."""
    finish, dtype = (lambda: None), np.float32
    if decode == "gpu":
        import cupy
        finish, dtype = cupy.cuda.get_current_stream().synchronize, np.float16
    loader = Loader(path, batch, train=True, image_size=image_size, workers=workers, prefetch=2,
                    dtype=dtype, decode=decode)
    try:
        seconds, cpu, images = _time_batches(_forever(loader), count, finish)
    finally:
        loader.close()
    timing = {"images_per_s": images / seconds, "images_per_cpu_s": images / cpu,
              "seconds": seconds, "images": images, "consumer_wait_s": loader.wait_time}
    if decode == "gpu":     # a figure of the GPU's decoding only where it did the decoding
        timing["host_decoded"] = loader.host_decoded
    return timing


def _torch_dataset(path, image_size):
    import torch

    class H5Images(torch.utils.data.Dataset):
        """The PIL pipeline of torchvision's ImageNet example, reading the same file."""

        def __init__(self):
            with Reader(path) as r:
                self.labels, self.mean, self.std = r.labels, r.mean / 255, r.std / 255
            self.reader = None      # opened in each worker process

        def __len__(self):
            return len(self.labels)

        def __getitem__(self, i):
            if self.reader is None:
                self.reader = Reader(path, check=False)
                self.rng = np.random.default_rng(torch.initial_seed() % 2 ** 32)
            im = Image.open(io.BytesIO(self.reader.record(i))).convert("RGB")
            x0, y0, w, h = random_resized_crop_box(im.size[0], im.size[1], self.rng)
            im = im.crop((x0, y0, x0 + w, y0 + h)).resize((image_size, image_size),
                                                          Image.BILINEAR)
            if self.rng.random() < 0.5:
                im = im.transpose(Image.FLIP_LEFT_RIGHT)
            t = torch.from_numpy(np.array(im, np.uint8, copy=True))
            t = t.permute(2, 0, 1).contiguous().to(torch.float32).div(255)     # ToTensor
            mean = torch.as_tensor(self.mean, dtype=torch.float32)[:, None, None]
            std = torch.as_tensor(self.std, dtype=torch.float32)[:, None, None]
            return t.sub_(mean).div_(std), int(self.labels[i])                 # Normalize

    return H5Images()


def bench_torch(path, workers, batch, image_size, count):
    import torch
    data = torch.utils.data.DataLoader(
        _torch_dataset(path, image_size), batch_size=batch, shuffle=True, drop_last=True,
        num_workers=workers, persistent_workers=workers > 0)

    def forever():
        while True:
            yield from data
    seconds, cpu, images = _time_batches(forever(), count)
    return {"images_per_s": images / seconds, "images_per_cpu_s": images / cpu,
            "seconds": seconds, "images": images}


def run(path, workers=2, batch=32, image_size=224, reference=None, json_out=False, batches=None,
        device="cpu", rounds=1):
    """Benchmark the loader on `path` (and the reference); prints and returns the results.

    batches: how many batches to time (default: two epochs' worth, at least 96).
    device="gpu": the loader decoding on the GPU with `workers` threads, against the CPU
    loader with a worker per core (the caller has checked that a GPU and nvImageCodec
    are there: mpitrain.checks.check_decode).
    rounds: time the loader (and the reference) this many times, taking turns at going
    first; each side's figures are those of its median round by images per CPU-second,
    each ratio the median of the rounds' ratios (a host's speed drifts from one minute
    to the next, and a round's two sides run within a minute of each other).
    """
    if reference not in (None, "torch"):
        raise ValueError(f"unknown reference {reference!r} (torch is the one there is)")
    with Reader(path) as r:
        n, storage = len(r), r.storage
        mean_bytes = r.offsets[-1] / n if storage == "encoded" else None
    count = batches or max(96, 2 * (n // batch))
    result = {"file": path, "records": n, "mean_record_bytes": mean_bytes,
              "workers": workers, "cores": cores(), "batch": batch, "image_size": image_size,
              "timed_batches": count, "device": device,
              "jpeg_decoder": "libjpeg-turbo (simplejpeg)" if simplejpeg else "Pillow"}
    timings = []
    for k in range(rounds):
        sides = ["mpitrain", "torch"] if reference else ["mpitrain"]
        timing = {"first": sides[k % len(sides)]}
        for side in sides[k % len(sides):] + sides[:k % len(sides)]:
            timing[side] = bench_mpitrain(path, workers, batch, image_size, count, decode=device) \
                if side == "mpitrain" else bench_torch(path, workers, batch, image_size, count)
            timing[side]["per_worker"] = timing[side]["images_per_s"] / max(workers, 1)
        if reference:
            ours, theirs = timing["mpitrain"], timing["torch"]
            timing["ratio"] = ours["images_per_s"] / theirs["images_per_s"]
            timing["ratio_cpu"] = ours["images_per_cpu_s"] / theirs["images_per_cpu_s"]
        timings.append(timing)
    for side in ("mpitrain", "torch")[:1 + bool(reference)]:
        by_cpu = sorted(timings, key=lambda timing: timing[side]["images_per_cpu_s"])
        result[side] = by_cpu[(rounds - 1) // 2][side]
    if reference:
        result["ratio"] = _median([timing["ratio"] for timing in timings])
        result["ratio_cpu"] = _median([timing["ratio_cpu"] for timing in timings])
    if rounds > 1:
        result["rounds"] = [{key: value if key in ("first", "ratio", "ratio_cpu") else
                             {"images_per_s": value["images_per_s"],
                              "images_per_cpu_s": value["images_per_cpu_s"]}
                             for key, value in timing.items()} for timing in timings]
    if device == "gpu":
        every = cores()
        host = bench_mpitrain(path, every, batch, image_size, count)
        host.update(workers=every, per_worker=host["images_per_s"] / every)
        result["cpu_every_core"] = host
        result["gpu_over_cpu"] = result["mpitrain"]["images_per_s"] / host["images_per_s"]
    if json_out:
        print(json.dumps(result))
    else:
        _print(result)
    return result


def _print(result):
    decoder = "nvImageCodec on the GPU" if result["device"] == "gpu" else result["jpeg_decoder"]
    print(f"{result['file']}: {result['records']} records, {result['workers']} worker(s), batch "
          f"{result['batch']}, {result['image_size']}x{result['image_size']} training crops, "
          f"{result['timed_batches']} batches timed, JPEG decoder: {decoder}")
    if result["device"] == "cpu" and result["workers"] > result["cores"]:
        print(f"  ({result['workers']} workers on {result['cores']} cores: they take turns, so "
              f"images/s is what the cores decode, and each worker's share falls)")
    for k, timing in enumerate(result.get("rounds", [])):
        ours = timing["mpitrain"]
        line = (f"  round {k + 1} ({timing['first']} first): mpitrain "
                f"{ours['images_per_s']:.1f} images/s, {ours['images_per_cpu_s']:.1f} per "
                f"CPU-second")
        if "torch" in timing:
            theirs = timing["torch"]
            line += (f"; torch {theirs['images_per_s']:.1f}, {theirs['images_per_cpu_s']:.1f}; "
                     f"ratio {timing['ratio_cpu']:.2f}x per CPU-second")
        print(line)
    # (name, figures, whether they are a median round's)
    rows = [("mpitrain" if result["device"] == "cpu" else "gpu", result["mpitrain"], True)]
    if "cpu_every_core" in result:
        rows.append((f"cpu x{result['cpu_every_core']['workers']}", result["cpu_every_core"],
                     False))
    rows += [("torch", result["torch"], True)] if "torch" in result else []
    for name, r, rounded in rows:
        print(f"  {name:9s} {r['images_per_s']:8.1f} images/s  "
              f"{r['per_worker']:7.1f} per worker  {r['images_per_cpu_s']:7.1f} per CPU-second"
              + (" (median round)" if rounded and "rounds" in result else ""))
    if "host_decoded" in result["mpitrain"]:
        print(f"  records decoded on the host, not on the GPU: "
              f"{result['mpitrain']['host_decoded']:,} (formats nvImageCodec is not given, "
              f"and records it fails on)")
    if "gpu_over_cpu" in result:
        print(f"  the GPU decodes {result['gpu_over_cpu']:.2f}x the images/s of the CPU "
              f"loader on every core")
    if "ratio" in result:
        print(f"  ratio     {result['ratio']:.2f}x images/s, "
              f"{result['ratio_cpu']:.2f}x per CPU-second"
              + (f" (median of {len(result['rounds'])} rounds)" if "rounds" in result else ""))

