"""Benchmarks, each run as `python -m mpitrain bench NAME` (docs/benchmarks.md has the
figures and how to read them):

    step     step.py    full training steps (forward + loss, backward, SGD update) on
                        random data, optionally against PyTorch; under mpirun, the
                        scaling over ranks and the communication hidden behind backward
    update   update.py  one LARS optimizer step over a model's arena, per kernel
                        implementation, against the memory bandwidth
    comm     comm.py    the gradient all-reduce: algorithms, fused vs per tensor,
                        fp16 vs fp32, a sweep of buffer sizes
    data     data.py    the loader (read, decode, augment), optionally against a
                        PyTorch DataLoader

reference_torch.py holds the PyTorch twins of the networks, used by the tests and by
`bench step --reference torch`.
"""
