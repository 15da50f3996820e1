"""`--fusion-threshold auto`: the bucket size chosen by timing the first training steps.

Horovod's autotune reduced to its one knob here. The candidates are the sizes of
CANDIDATES that give this arena different bucket layouts (bucket_bounds): above
the model's size every threshold makes one bucket, so a small model has few to
try. Each candidate runs STEPS ordinary training steps in turn; the first
step after a change is not counted (the new buckets' first sums find cold
buffers), the median of the others is the candidate's time. After the last
candidate rank 0 picks the fastest and broadcasts it, so every rank adopts the
same layout; the ranks' step times differ, and a choice that differed between
ranks would slice the sum differently on each.

Rank 0's step time includes the wait in the all-reduce for the slowest rank,
so it is the time of the job's step. The steps taken while tuning are real
training steps: only the slicing of the gradient sum differs between them. The
tuner's measurements and choice go into checkpoints (`state_dict`), so that a
resumed run keeps the bucket layout it chose (an all-reduce's rounding can
depend on the message size, and with it the bits of the run), or goes on
measuring where it left off.
"""
import statistics

from .buckets import bucket_bounds

CANDIDATES = tuple(1 << s for s in range(14, 28, 2))     # 16 KiB, 64 KiB, ... 64 MiB
STEPS = 4                                               # per candidate; the first not counted


class FusionTuner:
    """Which fusion threshold the next step uses, and, once all are measured, the choice.

        tuner = FusionTuner(arena, comm)
        reducer = Reducer(arena, comm, tuner.threshold, ...)
        for each step:
            seconds = time of the step
            if tuner.record(seconds):     # collective on the step that ends the tuning
                reducer.close(); reducer = Reducer(arena, comm, tuner.threshold, ...)
    """

    def __init__(self, arena, comm, candidates=CANDIDATES, steps=STEPS):
        if steps < 2:
            raise ValueError(f"each candidate needs at least 2 steps (1 not counted), got {steps}")
        self.comm, self.steps = comm, int(steps)
        layouts = {}
        for t in sorted(candidates):
            layouts.setdefault(tuple(bucket_bounds(arena, t)), t)
        self.candidates = sorted(layouts.values())
        self.buckets = {t: len(b) for b, t in layouts.items()}
        self.times = [[] for _ in self.candidates]      # seconds of every step taken with each
        self.chosen = self.candidates[0] if len(self.candidates) == 1 else None

    @property
    def threshold(self):
        """The threshold for the next step: the choice, or the candidate being measured."""
        if self.chosen is not None:
            return self.chosen
        return next(t for t, ts in zip(self.candidates, self.times) if len(ts) < self.steps)

    def record(self, seconds):
        """Count a step that used `self.threshold`. Returns True when this step ended a
        candidate's measurements: the next step takes another candidate, or the choice
        (which may be the same size). Collective on the step that measures the last
        candidate: every rank must call it every step."""
        if self.chosen is not None:
            return False
        times = self.times[self.candidates.index(self.threshold)]
        times.append(float(seconds))
        if all(len(ts) == self.steps for ts in self.times):
            best = min(self.candidates, key=self.median) if self.comm.rank == 0 else None
            self.chosen = self.comm.bcast(best, root=0)
        return len(times) == self.steps

    def median(self, threshold):
        """The median seconds of the counted steps taken with `threshold` (None: none yet)."""
        counted = self.times[self.candidates.index(threshold)][1:]
        return statistics.median(counted) if counted else None

    def describe(self):
        """One line: every candidate's buckets and median step time, and the choice."""
        parts = []
        for t in self.candidates:
            m = self.median(t)
            shown = f"{1e3 * m:.1f} ms" if m is not None else "not measured"
            parts.append(f"{_size(t)} ({self.buckets[t]} bucket(s)) {shown}")
        choice = f"chose {_size(self.chosen)}" if self.chosen is not None else "still measuring"
        return f"fusion threshold auto: {choice}; median step per threshold: " + ", ".join(parts)

    def state_dict(self):
        """JSON-able: the measurements and the choice (rank 0's, which decides)."""
        return {"candidates": list(self.candidates), "times": [list(ts) for ts in self.times],
                "chosen": self.chosen}

    def load_state_dict(self, state):
        """Continue from `state_dict()`'s; measurements for another set of candidates (a
        different model) are refused."""
        if list(state["candidates"]) != self.candidates:
            raise ValueError(f"the saved fusion candidates {state['candidates']} are not this "
                             f"model's {self.candidates}")
        self.times = [[float(s) for s in ts] for ts in state["times"]]
        self.chosen = state["chosen"]


def _size(nbytes):
    """16 KiB, 4 MiB: the candidates are powers of two."""
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
