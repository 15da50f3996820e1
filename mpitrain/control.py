"""Run control: stopping on signals, the stall watchdog and its heartbeat files.

    StopSignals   SIGTERM and SIGUSR1 set a flag that the training loop reads
                  between steps; the ranks agree on it, write a checkpoint and exit
    Watchdog      ends the whole job when no step completes for a while, naming
                  the ranks that did not arrive (from heartbeat files in the run
                  directory)
"""
import os
import signal
import sys
import threading
import time


class StopSignals:
    """SIGTERM and SIGUSR1 (what Slurm sends before a time limit, with --signal) only set
    a flag here; the training loop looks at it between steps, the ranks agree on it with
    an all-reduce (MAX), write a checkpoint and stop. Installed only in the main thread;
    `restore()` puts the previous handlers back."""

    EXIT_STATUS = {"SIGUSR1": 0, "SIGTERM": 143}     # 143 = 128 + 15, as a shell reports

    def __init__(self, signals=("SIGTERM", "SIGUSR1")):
        self.received = 0
        self.previous = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for name in signals:
            num = getattr(signal, name)
            self.previous[num] = signal.signal(num, self._handle)

    def _handle(self, signum, frame):
        self.received = signum

    def restore(self):
        for num, handler in self.previous.items():
            signal.signal(num, handler)
        self.previous = {}


class Watchdog:
    """Ends the whole job (MPI Abort, status 3) when no progress is reported for `timeout`
    seconds: a rank that stalls or dies keeps the others waiting in their next collective,
    and their watchdogs fire.

    The trainer calls `beat(where)` after every step and around evaluations and
    checkpoint writes, so `timeout` must exceed the longest of those. The message names
    this rank, the last thing it completed and, from `activity()` (Timeline.activity),
    the phase it is stuck in; the first rank whose watchdog fires ends the job, which
    is a rank waiting for the late one (typically in 'all-reduce').

    The late ranks are named from a heartbeat board: a directory (in the run directory)
    with one small file per rank, overwritten in place with the rank's position, a
    count of beats and phases entered (`entered`, the Timeline's listener) that
    advances identically on every rank. A stalled rank cannot report, but its file
    still says where it stopped; the ranks behind the furthest one did not arrive.
    Posting costs one pwrite of 128 bytes per phase, no message.
    """

    def __init__(self, timeout, comm, stream=None, activity=None, board=None):
        self.timeout, self.comm = float(timeout), comm
        self.stream = stream or sys.stderr
        self.activity = activity or (lambda: None)
        self.where = "start"
        self.last = time.monotonic()
        self.count = 0
        self.board, self._fd = board, None
        if board:
            os.makedirs(board, exist_ok=True)
            self._fd = os.open(os.path.join(board, f"rank{comm.rank}"),
                               os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self.thread.start()

    def beat(self, where):
        self.where, self.last = where, time.monotonic()
        self._post(f"after {where}")

    def entered(self, phase):
        """The main thread entered a phase (a Timeline span): post the position."""
        self._post(f"in '{phase}' after {self.where}")

    def _post(self, where):
        self.count += 1
        if self._fd is not None:
            os.pwrite(self._fd, f"{self.count:>14d} {where[:112]:<112}\n".encode(), 0)

    def late_ranks(self):
        """[(rank, position)] of the ranks behind the furthest one on the board."""
        positions = {}
        for r in range(self.comm.size):
            try:
                with open(os.path.join(self.board, f"rank{r}")) as f:
                    text = f.read()
                positions[r] = int(text[:14]), text[15:].strip()
            except (OSError, ValueError):
                positions[r] = -1, "no heartbeat (is the run directory on a shared file system?)"
        furthest = max(count for count, _ in positions.values())
        return [(r, where) for r, (count, where) in positions.items() if count < furthest]

    def _watch(self):
        period = min(1.0, self.timeout / 4)
        while not self._stop.wait(period):
            idle = time.monotonic() - self.last
            if idle > self.timeout:
                now = self.activity()
                late = self.late_ranks() if self.board else []
                who = ("; ranks that did not arrive: " + ", ".join(
                    f"rank {r} ({where})" for r, where in late)) if late else \
                    "; a rank is stalled or has not arrived in the collective"
                self.stream.write(
                    f"rank {self.comm.rank} of {self.comm.size}: no progress for {idle:.0f} s "
                    f"(--collective-timeout {self.timeout:g}) after {self.where}"
                    f"{', ' + now if now else ''}{who}. Ending the job.\n")
                self.stream.flush()
                time.sleep(1.0)         # let the launcher forward the message before the abort
                self.comm.abort(3)

    def close(self):
        self._stop.set()
        self.thread.join()
        if self._fd is not None:
            os.close(self._fd)
