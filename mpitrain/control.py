"""Run control: stopping on signals, the heartbeat files and the stall watchdog.

    StopSignals   SIGTERM, SIGINT and SIGUSR1 ask the run to stop: between steps the
                  ranks agree on it, write a checkpoint and exit; a second SIGINT, a
                  rank that cannot reach the next step, or a launcher that is gone
                  (LauncherWatch) ends the job at once
    Heartbeats    RUN_DIR/heartbeat/rank<N>: where each rank is (pid, host, position)
    Watchdog      ends the job when no step completes for a while, naming the ranks
                  that did not arrive or stopped living
    LossWatch     finds a run whose loss has exploded without turning inf or NaN
    end_job       the one way a rank ends the whole job (MPI Abort), its last words kept
"""
import array
import contextlib
import fcntl
import os
import select
import signal
import socket
import stat
import statistics
import sys
import termios
import threading
import time
from collections import deque

# status of a run that stopped on a signal: 0 after SIGUSR1 (stopped on request, resumable),
# 128 + the signal's number otherwise, as a shell reports a process ended by it
EXIT_STATUS = {"SIGUSR1": 0, "SIGTERM": 128 + signal.SIGTERM, "SIGINT": 128 + signal.SIGINT}
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")     # in the order of precedence
# status of a job whose launcher is gone: as a process whose terminal hung up
LAUNCHER_GONE = 128 + signal.SIGHUP
# seconds between two looks at the launcher
LAUNCHER_POLL = 1.0
# seconds a rank ending the job waits for the launcher to read what the rank last wrote
FORWARD_WAIT = 2.0
# seconds an MPI Abort may take before the process ends itself; less once the launcher,
# which carries the abort out, is gone (every rank watches it and ends itself alike)
ABORT_FALLBACK = 10
ORPHAN_ABORT_FALLBACK = 3


def unread(fd):
    """Bytes written to `fd` that its reader has not read yet, when fd is a pipe (as
    a launcher gives each rank's stdout and stderr); 0 for anything else."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return 0
        count = array.array("i", [0])
        fcntl.ioctl(fd, termios.FIONREAD, count)
    except OSError:                                 # closed
        return 0
    return count[0]


def wait_until_read(fds=(1, 2), timeout=FORWARD_WAIT):
    """Wait, at most `timeout` seconds in all, until every pipe among `fds` is empty."""
    end = time.monotonic() + timeout
    for fd in fds:
        while unread(fd) and time.monotonic() < end:
            time.sleep(0.001)


def end_job(world, status, fallback=ABORT_FALLBACK):
    """End every rank of the job at once: MPI Abort of `world` with `status`.

    A launcher forwards each rank's output from a pipe, and it kills the job the moment
    the abort reaches it, whatever the pipe still holds: the message saying why the job
    ends would be lost now and then. So the rank first waits until the launcher has
    read what it wrote (wait_until_read), at most FORWARD_WAIT seconds.

    The watchdog and the signal watcher end the job from their own threads while the
    main thread may be blocked inside a collective, and an MPI library may make the
    abort wait for that collective's lock. So an alarm goes off first: if the abort
    has not ended the process `fallback` seconds later, SIGALRM's default action
    kills it (mpitrain installs no handler, which would need the GIL), and the
    launcher ends the rest of a job one of whose ranks died."""
    signal.alarm(fallback)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):               # closed
            pass
    wait_until_read()
    world.Abort(status)


def _start_time(pid):
    """The start time of process `pid` (clock ticks since boot, /proc/PID/stat's 22nd field),
    which tells it from a later process given the same pid; None when there is no such
    process or it has ended (a zombie). Without /proc: 0 for any live pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()     # the name may hold spaces
        return None if fields[0] in "ZX" else int(fields[19])
    except FileNotFoundError:
        if os.path.isdir("/proc"):
            return None
    except (OSError, IndexError, ValueError):
        return None
    try:
        os.kill(pid, 0)
        return 0
    except ProcessLookupError:
        return None
    except PermissionError:
        return 0


class LauncherWatch:
    """Whether the processes that started this rank are still there.

    kill -9 of launch.sh, or of the launcher, leaves the ranks running: launch.sh
    runs mpiexec in a process group of its own (Ctrl-C reaches launch.sh alone) and
    Open MPI gives each rank one more, so no signal reaches them; they would train on
    and keep writing into the run directory. Two processes are watched:

      - launch.sh itself (or `study`), named by MPITRAIN_LAUNCHER_PID (and
        MPITRAIN_LAUNCHER_HOST: a rank on another host cannot see it), which it exports;
        its start time tells it from a later process given the same pid;
      - under an MPI launcher, this rank's parent (mpiexec's proxy, mpirun, Slurm's
        step daemon): a rank whose parent died is handed to another process.

    `gone()` says which is gone (None while both are there)."""

    def __init__(self, environ=None):
        from .launcher import LAUNCHERS
        environ = os.environ if environ is None else environ
        self.parent = os.getppid() if any(environ.get(rank, "").isdigit()
                                          for rank, _ in LAUNCHERS) else None
        pid, host = environ.get("MPITRAIN_LAUNCHER_PID", ""), environ.get("MPITRAIN_LAUNCHER_HOST")
        self.launcher = None
        if pid.isdigit() and host in (None, socket.gethostname()):
            self.launcher = (int(pid), _start_time(int(pid)))

    def gone(self):
        if self.launcher is not None:
            pid, started = self.launcher
            if started is None or _start_time(pid) != started:
                return f"the launching process (pid {pid}, MPITRAIN_LAUNCHER_PID) is gone"
        if self.parent is not None and os.getppid() != self.parent:
            return (f"this rank's parent process (pid {self.parent}: the MPI launcher or its "
                    f"proxy) is gone")
        return None


# the stop signals a run received before its StopSignals existed (record_early)
EARLY = set()


def record_early():
    """From the start of `train` until its StopSignals exists, a SIGUSR1 is recorded in
    EARLY (StopSignals takes it over): Slurm's --signal may come within seconds of a
    job's start, and a run asked to stop then still checkpoints at its first step and
    exits 0. Without it the signal's default action ends the process before MPI starts,
    and after it the signal is lost (MPICH's own handler passes it on only to a handler
    set before it). SIGTERM and SIGINT end the process at once as before: there is
    nothing to save yet."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, lambda signum, frame: EARLY.add("SIGUSR1"))


class StopSignals:
    """SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 (what Slurm sends before a time limit, with
    --signal) only record themselves here; after each step the ranks agree on
    `pending()` (any rank's signal stops every rank), write a checkpoint and exit with
    EXIT_STATUS.

    Python runs signal handlers in the main thread between bytecodes, so a rank whose
    main thread is blocked inside a collective (waiting for a rank that stalled or
    died) never gets to see its signal. A watcher thread therefore sees every signal
    too, the moment it arrives (`signal.set_wakeup_fd`: the C-level handler writes the
    signal's number to a pipe), and ends the job itself (MPI Abort, the signal's
    status) when
      - a second SIGINT arrives: Ctrl-C twice means now, without a checkpoint;
      - the run has not acted on a stop signal within `grace()` seconds (`acted()`
        was not called): it cannot reach the next step boundary.
    The grace is `grace` seconds when given, else four times the longest interval
    seen between two step boundaries (`mark()`), and at least MIN_GRACE. Work the ranks
    do together between two steps that may take longer, such as a first evaluation or
    checkpoint, runs inside `busy()`: a signal's grace starts when it ends.
    The watcher also looks at `launcher` (a LauncherWatch) every LAUNCHER_POLL seconds
    and ends the job (status LAUNCHER_GONE) once the launcher is gone: nothing else
    would stop the ranks then, nor read what they print.

    Installed only in the main thread; `restore()` puts the previous handlers back. A
    SIGUSR1 that came before (record_early) counts as received.
    """

    MIN_GRACE = 30.0

    def __init__(self, comm, grace=None, stream=None, launcher=None):
        self.comm, self.fixed_grace, self.launcher = comm, grace, launcher
        self.stream = stream or sys.stderr
        self.received = set(EARLY)          # names of the signals the main thread has seen
        EARLY.clear()
        self.previous = {}
        self._longest, self._last_mark = 0.0, time.monotonic()
        self._busy, self._free_at = 0, 0.0     # inside busy(); when it was last left
        self._acted = threading.Event()
        self._thread = None
        if threading.current_thread() is not threading.main_thread():
            return
        for name in STOP_SIGNALS:
            num = getattr(signal, name)
            self.previous[num] = signal.signal(num, self._handle)
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._wakeup = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="mpitrain-signals",
                                        daemon=True)
        self._thread.start()

    def _handle(self, signum, frame):
        self.received.add(signal.Signals(signum).name)

    def pending(self):
        """[1 or 0 for each of STOP_SIGNALS]: what this rank has received, for the ranks
        to agree on (summed over the ranks, a non-zero entry stops them all)."""
        return [int(name in self.received) for name in STOP_SIGNALS]

    def mark(self):
        """A step boundary was passed (the ranks agreed): the grace adapts to the longest
        interval between two of them."""
        now = time.monotonic()
        self._longest = max(self._longest, now - self._last_mark)
        self._last_mark = now

    def grace(self):
        if self.fixed_grace is not None:
            return self.fixed_grace
        return max(self.MIN_GRACE, 4.0 * self._longest)

    @contextlib.contextmanager
    def busy(self):
        """Evaluation, a checkpoint: a stop signal waits for the next step boundary,
        and its grace is counted from the end of this block."""
        self._busy += 1
        try:
            yield
        finally:
            self._free_at = time.monotonic()
            self._busy -= 1

    def acted(self):
        """The ranks agreed to stop: the watcher leaves the rest to the run."""
        self._acted.set()

    def _due(self, since):
        """When a stop signal that arrived at `since` has waited its grace: later while
        the run is busy(), and counted from the end of its last busy() block."""
        if self._busy:
            return time.monotonic() + self.grace()
        return max(since, self._free_at) + self.grace()

    def _watch(self):
        first = deadline = since = None
        counts = dict.fromkeys(STOP_SIGNALS, 0)
        while True:
            waiting = deadline is not None and not self._acted.is_set()
            wait = max(0.0, deadline - time.monotonic()) if waiting else None
            if self.launcher is not None:
                wait = LAUNCHER_POLL if wait is None else min(wait, LAUNCHER_POLL)
            readable, _, _ = select.select([self._read], [], [], wait)
            if not readable:
                if waiting and time.monotonic() >= deadline:
                    deadline = self._due(since)
                if waiting and time.monotonic() >= deadline:     # the grace ran out
                    self._abort(first, f"{first} arrived {time.monotonic() - since:.0f} s "
                                       f"ago, but this rank has not reached the next step "
                                       f"boundary (its main thread is blocked, likely in a "
                                       f"collective waiting for a rank that stalled or died)")
                gone = self.launcher.gone() if self.launcher is not None else None
                if gone:
                    self._end(LAUNCHER_GONE, f"{gone}, and with it what would stop this job",
                              ORPHAN_ABORT_FALLBACK)
                continue
            data = os.read(self._read, 64)
            if not data:                             # restore() closed the pipe
                return
            for num in data:
                name = signal.Signals(num).name if num in signal.valid_signals() else None
                if name not in counts:
                    continue
                counts[name] += 1
                if name == "SIGINT" and counts[name] == 2:
                    self._abort(name, "a second SIGINT: stopping now, without a checkpoint")
                if first is None:
                    first, since = name, time.monotonic()
                    deadline = self._due(since)

    def _abort(self, name, why):
        self._end(EXIT_STATUS[name] or 128 + getattr(signal, name), why)

    def _end(self, status, why, fallback=ABORT_FALLBACK):
        try:                                         # a launcher that is gone reads nothing
            self.stream.write(f"rank {self.comm.rank} of {self.comm.size}: {why}. Ending the "
                              f"job (status {status}).\n")
            self.stream.flush()
        except OSError:
            pass
        self.comm.abort(status, fallback)

    def restore(self):
        """Put the previous handlers back and stop the watcher."""
        for num, handler in self.previous.items():
            signal.signal(num, handler)
        self.previous = {}
        if self._thread is not None:
            signal.set_wakeup_fd(self._wakeup)
            os.close(self._write)                    # the watcher reads end-of-file
            self._thread.join()
            os.close(self._read)
            self._thread = None


def stop_signal(counts):
    """The name of the signal that stops the run, from the ranks' summed `pending()`
    counts (STOP_SIGNALS order decides between several), or None."""
    for name, n in zip(STOP_SIGNALS, counts):
        if n:
            return name
    return None


class Heartbeats:
    """Where every rank is, in files a person (or the watchdog of another rank) can read:
    RUN_DIR/heartbeat/rank<N>, one line per rank, overwritten in place:

        pid host count alive position

    pid and host name the process (to signal it, or attach a debugger); count counts
    the step boundaries and phases the rank has passed, which advances identically on
    every rank, so a rank with a smaller count is behind; alive is the Unix time at
    which the rank last showed a sign of life: its watchdog thread (--collective-timeout)
    renews it every second even while the main thread waits in a collective, so an
    `alive` that falls behind means the process is frozen, stopped or dead; position is
    where its main thread is ("in 'all-reduce' after step 12").

    The line is a shared memory map of the file, so a post is a copy into memory: no
    system call, which in the main thread would hand the GIL to the loader's threads
    and wait to get it back, several times a step. Other processes of the host see it
    at once; `sync()` (the watchdog thread, every second) writes it through for ranks
    on other hosts, which read the file over a shared file system.
    """

    LINE = 180

    def __init__(self, directory, comm):
        import mmap
        self.directory, self.comm = directory, comm
        os.makedirs(directory, exist_ok=True)
        self.pid, self.host = os.getpid(), socket.gethostname()
        self.count, self.where = 0, "starting"
        self._lock = threading.Lock()
        with open(os.path.join(directory, f"rank{comm.rank}"), "w+b") as f:
            f.write(b" " * (self.LINE - 1) + b"\n")
            f.flush()
            self._map = mmap.mmap(f.fileno(), self.LINE)
        self.alive()

    def post(self, where):
        """The main thread passed a step boundary or entered a phase."""
        with self._lock:
            self.count += 1
            self.where = where
        self.alive()

    def alive(self):
        with self._lock:
            line = (f"{self.pid} {self.host} {self.count} {time.time():.3f} "
                    f"{self.where}")[:self.LINE - 1]
            self._map[:] = f"{line:<{self.LINE - 1}}\n".encode()

    def sync(self):
        self._map.flush()

    def close(self):
        self._map.close()


def read_heartbeats(directory, size):
    """{rank: dict(pid, host, count, alive, where)} of the heartbeat files of `size` ranks;
    a rank without a readable file maps to None."""
    board = {}
    for r in range(size):
        try:
            with open(os.path.join(directory, f"rank{r}")) as f:
                pid, host, count, alive, where = f.read().split(" ", 4)
            board[r] = dict(pid=int(pid), host=host, count=int(count), alive=float(alive),
                            where=where.strip())
        except (OSError, ValueError):
            board[r] = None
    return board


class Watchdog:
    """Ends the whole job (MPI Abort, status 3) when no step boundary, evaluation or
    checkpoint is reached for `timeout` seconds: a rank that stalls or dies keeps the
    others waiting in their next collective, and their watchdogs fire.

    The trainer calls `beat(where)` after every step and around evaluations and
    checkpoint writes, so `timeout` must exceed the longest of those. The message names
    this rank, the last thing it completed, the phase it is stuck in (`activity()`,
    Timeline.activity), and, from the heartbeat files, the ranks to blame: those whose
    count is behind the furthest rank's (they did not arrive) and those whose `alive`
    time stopped (frozen, stopped or dead: named even when they stopped inside the
    collective the others wait in). The thread renews this rank's `alive` every second.
    """

    def __init__(self, timeout, comm, heartbeats, activity=None, stream=None):
        self.timeout, self.comm, self.heartbeats = float(timeout), comm, heartbeats
        self.stream = stream or sys.stderr
        self.activity = activity or (lambda: None)
        self.where = "start"
        self.last = time.monotonic()
        self.period = min(1.0, self.timeout / 4)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="mpitrain-watchdog", daemon=True)
        self.thread.start()

    def beat(self, where):
        self.where, self.last = where, time.monotonic()

    def culprits(self):
        """[(rank, why)] of the ranks to blame for a stall, from the heartbeat files."""
        board = read_heartbeats(self.heartbeats.directory, self.comm.size)
        furthest = max((b["count"] for b in board.values() if b), default=0)
        quiet = max(2.0, 3 * self.period)           # seconds without a sign of life
        now, blamed = time.time(), []
        for r, b in board.items():
            if b is None:
                blamed.append((r, "no heartbeat file (is the run directory on a file system "
                                  "every node sees?)"))
            elif r != self.comm.rank and now - b["alive"] > quiet:
                blamed.append((r, f"no sign of life for {now - b['alive']:.0f} s, {b['where']}: "
                                  f"frozen, stopped or dead (pid {b['pid']} on {b['host']})"))
            elif b["count"] < furthest:
                blamed.append((r, f"did not arrive: {b['where']}"))
        return blamed

    def _watch(self):
        while not self._stop.wait(self.period):
            self.heartbeats.alive()
            self.heartbeats.sync()
            idle = time.monotonic() - self.last
            if idle > self.timeout:
                now = self.activity()
                blamed = self.culprits()
                who = ("; " + "; ".join(f"rank {r}: {why}" for r, why in blamed)) if blamed \
                    else "; no rank is behind or silent: a rank is stalled inside the collective"
                self.stream.write(
                    f"rank {self.comm.rank} of {self.comm.size}: no progress for {idle:.0f} s "
                    f"(--collective-timeout {self.timeout:g}) after {self.where}"
                    f"{', ' + now if now else ''}{who}. Ending the job.\n")
                self.stream.flush()
                self.comm.abort(3)

    def close(self):
        self._stop.set()
        self.thread.join()


class LossWatch:
    """Divergence that stays finite: the mean training loss of each step against the
    median of the last WINDOW steps. A loss above FACTOR times that median (and above it
    by more than MARGIN) for PATIENCE steps in a row has exploded; the first of those
    steps is where the divergence began. Every rank sees the same losses (summed over the
    ranks), so every rank reaches the same verdict."""

    WINDOW, FACTOR, MARGIN, PATIENCE, WARMUP = 100, 4.0, 1.0, 5, 20

    def __init__(self):
        self.history = deque(maxlen=self.WINDOW)    # the last WINDOW steps' losses
        self.streak = 0             # steps in a row above the threshold
        self.since = None           # global step at which the streak began

    def update(self, loss, global_step):
        """Record one step's mean loss; True when the run has diverged."""
        if len(self.history) >= self.WARMUP:
            median = statistics.median(self.history)
            if loss > self.FACTOR * median and loss > median + self.MARGIN:
                self.streak += 1
                self.since = self.since or global_step
                return self.streak >= self.PATIENCE     # a spike is kept out of the median
        self.streak, self.since = 0, None
        self.history.append(loss)
        return False

    def calm(self):
        return self.streak == 0

    def state_dict(self):
        return {"history": list(self.history)}

    def load_state_dict(self, state):
        self.history = deque(state.get("history", []), maxlen=self.WINDOW)
