"""The parallel image-folder converter, under `mpirun -np N python -m mpi4py -m pytest tests/mpi`.

Every rank validates an interleaved share, rank 0 writes; the files must equal
a serial conversion of the same folder, whatever N (1 works too). Rank 0
compares and broadcasts what differs, so every rank passes or fails together.
"""
import io
import os

import h5py
import numpy as np
import pytest
from mpi4py import MPI
from PIL import Image

from mpitrain.datasets import convert

pytestmark = pytest.mark.mpi

comm = MPI.COMM_WORLD


def make_folder(root, n=23, classes=3):
    rng = np.random.default_rng(0)
    for i in range(n):
        folder = os.path.join(root, f"class{i % classes}")
        os.makedirs(folder, exist_ok=True)
        rgb = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, "JPEG" if i % 2 else "PNG")
        data = buf.getvalue()
        if i % 7 == 3:
            data = data[:len(data) // 3]                 # truncated: must be skipped
        with open(os.path.join(folder, f"{i:02d}.img"), "wb") as fh:
            fh.write(data)


def test_parallel_conversion_equals_serial(shared_dir, monkeypatch):
    monkeypatch.setattr(convert, "ROUND", 2)             # several gather rounds
    src = os.path.join(shared_dir, "src")
    if comm.rank == 0:
        make_folder(src)
    comm.Barrier()
    dst = os.path.join(shared_dir, "parallel.h5")
    result = convert.convert_imagefolder(src, dst, val_fraction=0.3, seed=1, comm=comm)
    assert len(result.skipped) == 3                      # the same answer on every rank
    differences = []
    if comm.rank == 0:
        ref = os.path.join(shared_dir, "serial.h5")
        serial = convert.convert_imagefolder(src, ref, val_fraction=0.3, seed=1)
        if serial.skipped != result.skipped or serial.counts != result.counts:
            differences.append(f"serial {serial} != parallel {result}")
        for a, b in ((dst, ref), (convert.val_path(dst), convert.val_path(ref))):
            with h5py.File(a) as fa, h5py.File(b) as fb:
                differences += [f"{a}: {key}" for key in
                                ("labels", "offsets", "images", "filenames", "mean", "std")
                                if not np.array_equal(fa[key][:], fb[key][:])]
    assert comm.bcast(differences) == []
