"""Replica consistency: every rank must hold the same master weights, bit for bit."""
import zlib

from mpitrain import backend


class ReplicaMismatch(RuntimeError):
    """The ranks' master weights differ; raised on every rank alike."""


def checksum(arena):
    """crc32 of the bytes of the fp32 master arena (changes with any bit of any weight)."""
    return zlib.crc32(memoryview(backend.to_numpy(arena.master)).cast("B"))


def check_replicas(arena, comm, step=None):
    """Collective over the Communicator `comm`: raise ReplicaMismatch on every rank,
    naming the ranks whose master weights differ from rank 0's, when the checksums do
    not all agree."""
    sums = comm.allgather(checksum(arena))
    if len(set(sums)) > 1:
        differ = [r for r, s in enumerate(sums) if s != sums[0]]
        at = f" after step {step}" if step is not None else ""
        raise ReplicaMismatch(
            f"the replicas diverged{at}: the master weights of rank(s) {differ} differ from "
            f"rank 0's (crc32 {', '.join(f'rank {r}: {s:08x}' for r, s in enumerate(sums))}); "
            f"every rank must apply the same update to the same weights (a non-deterministic "
            f"kernel, or an all-reduce that is not bitwise identical on every rank?)")
