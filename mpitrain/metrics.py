"""Progress output for long work.

On a terminal the line redraws in place; elsewhere (a Slurm log, CI) it prints a
plain line every `every` seconds, so logs stay readable.
"""
import sys
import time


class Progress:
    """Call with (done, total) as work advances; `close()` prints the final line."""

    def __init__(self, what, stream=None, every=10.0):
        self.what = what
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = every
        self.start = self.last = time.perf_counter()
        self.done = self.total = 0

    def __call__(self, done, total):
        self.done, self.total = done, total
        now = time.perf_counter()
        if self.tty or now - self.last >= self.every:
            self.last = now
            self._write(now, end="\r" if self.tty else "\n")

    def _write(self, now, end):
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        percent = self.done / self.total if self.total else 1.0
        self.stream.write(f"{self.what}: {self.done}/{self.total} ({percent:.0%}) "
                          f"{rate:,.0f}/s, {elapsed:.0f} s elapsed, ETA {eta:.0f} s{end}")
        self.stream.flush()

    def close(self):
        self._write(time.perf_counter(), end="\n")
