"""Progress output, metrics records and the Chrome-trace timeline.

Progress on a terminal is a tqdm bar redrawn in place; elsewhere (a Slurm log,
CI) it is plain lines, so logs stay readable.
"""
import errno
import json
import os
import sys
import threading
import time

from tqdm import tqdm

from .files import save_json, save_text
from .launcher import output_is_terminal


class Progress:
    """Call with (done, total) as work advances; `close()` ends it. On a terminal a tqdm
    bar; elsewhere a plain line every `every` seconds and one at the end."""

    def __init__(self, what, stream=None, every=10.0):
        self.what = what
        self.stream = stream or sys.stderr
        self.every = every
        self.bar = tqdm(desc=what, file=self.stream, dynamic_ncols=True) \
            if output_is_terminal(self.stream) else None
        self.start = self.last = time.perf_counter()
        self.done = self.total = 0

    def __call__(self, done, total):
        self.done, self.total = done, total
        if self.bar is not None:
            self.bar.total = total
            self.bar.update(done - self.bar.n)
            return
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            self._line(now)

    def _line(self, now):
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        percent = self.done / self.total if self.total else 1.0
        self.stream.write(f"{self.what}: {self.done}/{self.total} ({percent:.0%}) "
                          f"{rate:,.0f}/s, {elapsed:.0f} s elapsed, ETA {eta:.0f} s\n")
        self.stream.flush()

    def close(self):
        if self.bar is not None:
            self.bar.close()
        else:
            self._line(time.perf_counter())


def trace_path(path, rank):
    """Where rank `rank` writes its trace: inside `path` when it is a directory (an existing
    one, or a name ending in '/'), else `path` with '.rankN' before its extension
    (trace.json -> trace.rank0.json)."""
    if path.endswith(os.sep) or os.path.isdir(path):
        return os.path.join(path, f"trace.rank{rank}.json")
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


class _Span:
    """Times one `with` block into its Timeline (and records the event when tracing)."""
    __slots__ = ("timeline", "name", "cat", "start", "outer")

    def __init__(self, timeline, name, cat):
        self.timeline, self.name, self.cat = timeline, name, cat

    def __enter__(self):
        self.start = time.perf_counter()
        if threading.current_thread() is threading.main_thread():
            self.outer, self.timeline.current = self.timeline.current, self
            # phases only: a rank with no validation images in a step runs no layers there,
            # and its count of spans entered (the heartbeat's) would fall behind the others'
            if self.timeline.listener is not None and self.cat not in Timeline.NESTED:
                self.timeline.listener(self.name)
        return self

    def __exit__(self, *exc):
        end = time.perf_counter()
        if threading.current_thread() is threading.main_thread():
            self.timeline.current = self.outer
        self.timeline.add(self.name, self.cat, self.start, end)
        return False


class _NoSpan:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_SPAN = _NoSpan()


class Timeline:
    """Phase times of the training loop, and optionally a Chrome-trace timeline.

    `with timeline.span("forward", "forward"):` times the block. Every span adds its
    duration to its category's total (`take_totals()` returns and resets them: the
    per-phase times of metrics.jsonl). With a `path`, each span is also kept as a
    Chrome-trace complete event ("ph": "X", ts and dur in microseconds, pid = rank,
    one tid per category) and `save()` writes {"traceEvents": [...]} to
    trace_path(path, rank); open it in https://ui.perfetto.dev or chrome://tracing.
    Timestamps are wall-clock microseconds, so the ranks of one host line up.
    `Timeline(enabled=False)` (or `Timeline.off()`) makes every span a no-op.
    Spans may nest and may come from other threads (a communication thread);
    `activity()` names the innermost span the main thread is in (for the watchdog).
    """

    def __init__(self, path=None, rank=0, enabled=True):
        self.path = trace_path(path, rank) if path else None
        self.rank = rank
        self.enabled = enabled
        self.totals = {}
        self.events = []
        self.tids = {}
        self.current = None
        self.listener = None        # called with the name of each phase the main thread enters
        self._perf0 = time.perf_counter()
        self._wall0 = time.time()
        self._lock = threading.Lock()

    # categories drawn in the trace but not summed into phase times: they nest inside one
    NESTED = {"layers"}

    def trace_layers(self, net, model):
        """Show forward and backward of each layer `net` runs in turn in the trace, category
        "layers", named as in `model` (the fast network's conv1, layer1, ..., fc; the plain
        layers' conv1, layer1.0, ..., their own ReLU by its type), through the network's
        run_layer hook (nets/module.py)."""
        from mpitrain.nets.module import run_layer
        names = {id(m): name[:-1] for name, m in model.named_modules() if name}
        if net is not model:        # the plain layers, by the fast layers they stand for
            names.update((id(plain), names[id(fast)]) for fast, plain in net.pairs if fast)

        def traced_run_layer(layer, phase, *args, **options):
            with self.span(f"{phase} {names.get(id(layer), type(layer).__name__)}", "layers"):
                return run_layer(layer, phase, *args, **options)
        net.run_layer = traced_run_layer

    @classmethod
    def off(cls):
        return cls(enabled=False)

    def span(self, name, cat="step"):
        """Context manager timing a block as event `name` in category `cat`."""
        return _Span(self, name, cat) if self.enabled else _NO_SPAN

    def add(self, name, cat, start, end):
        """Record a span measured elsewhere (perf_counter start and end, seconds)."""
        with self._lock:
            if cat not in self.NESTED:
                self.totals[cat] = self.totals.get(cat, 0.0) + (end - start)
            if self.path is not None:
                tid = self.tids.setdefault(cat, len(self.tids))
                self.events.append({"name": name, "cat": cat, "ph": "X", "pid": self.rank,
                                    "tid": tid, "ts": self._us(start),
                                    "dur": round((end - start) * 1e6, 3)})

    def _us(self, t):
        return round((self._wall0 + (t - self._perf0)) * 1e6, 3)

    def activity(self):
        """'NAME for S s': the innermost span the main thread is in, or None."""
        span = self.current
        if span is None:
            return None
        return f"in '{span.name}' for {time.perf_counter() - span.start:.0f} s"

    def take_totals(self):
        """{category: seconds} since the last call, then zeroed."""
        with self._lock:
            totals, self.totals = self.totals, {}
        return totals

    def save(self):
        """Write the trace file (if tracing); returns its path or None."""
        if self.path is None:
            return None
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                 "args": {"name": f"rank {self.rank}"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                  "args": {"name": cat}} for cat, tid in self.tids.items()]
        with self._lock:
            events = meta + self.events

        save_json(self.path, {"traceEvents": events, "displayTimeUnit": "ms"}, sort_keys=False,
                  indent=None)
        return self.path


class LossMean:
    """A step record's training loss: the mean over the ranks and the steps since the
    previous record. A rank's loss is the mean over its slice of the global batch, so it
    weighs 1/ranks of its step, and a run resumed on another number of ranks (the sums
    travel in its checkpoint) still weighs every step alike. Losses that are not finite
    are left out of the mean, and counted."""

    def __init__(self):
        # the finite losses, each times its rank's share of the step; those shares summed;
        # how many losses were finite; how many were not
        self.sums = [0.0, 0.0, 0, 0]

    def add(self, loss_sum, ranks, not_finite):
        """One step: `loss_sum`, its `ranks` ranks' finite losses summed, and how many of
        the ranks' losses were not finite."""
        finite = ranks - not_finite
        for i, value in enumerate((loss_sum / ranks, finite / ranks, finite, not_finite)):
            self.sums[i] += value

    def take(self):
        """(the mean loss, None when no loss was finite; the finite losses; the others),
        counted from zero again after."""
        weighted, share, finite, not_finite = self.sums
        self.sums = [0.0, 0.0, 0, 0]
        return (weighted / share if finite else None), finite, not_finite

    def state_dict(self):
        return list(self.sums)

    def load_state_dict(self, sums, world_size):
        """`sums` from state_dict(), in a checkpoint of `world_size` ranks; an older
        checkpoint's two or three numbers are the ranks' finite losses summed, their
        count and (the later ones) the count of the others."""
        if 0 < len(sums) < 4:
            loss_sum, finite, not_finite = (*sums, 0)[:3]
            sums = [loss_sum / world_size, finite / world_size, int(finite), int(not_finite)]
        self.sums = list(sums) if sums else [0.0, 0.0, 0, 0]


class MetricsLog:
    """metrics.jsonl: one JSON object per line, appended and flushed as it happens, so a
    resumed run continues the same file and a crash loses nothing written before it.

    Step records: {"kind": "step", "epoch", "step", "global_step", "loss" (the mean of the
    ranks' finite training losses since the previous record; null when none was finite),
    "losses_not_finite" (the ranks' losses left out of it), "top1" (the training top-1 of
    the images trained on since the previous record, over all ranks), "lr" (the last
    step's), "loss_scale" and "skipped_steps" (under loss scaling: the scale after the last
    step, which the next step uses, and the steps skipped on overflow so far),
    "images_per_s", "skipped_records", "time": {phase: seconds per step}}.
    Evaluation records: {"kind": "eval", "epoch", "global_step", "skipped_steps" (skipped
    on overflow under loss scaling, so far), "top1", "top5", "loss" (the validation
    set's mean cross-entropy, without label smoothing; null when some logits were not
    finite), "nonfinite" (images whose logits were not finite), "bad_records"
    (bad validation records, left out of the scores)}. A run that a divergence ends (its
    loss not finite or exploding, its overflows going on at the loss scale's floor
    where that is dynamic or a static 1 or less) ends the file with
    {"kind": "diverged", "global_step", "since" (the step where the divergence began)}.

    A record that the file system has no room for is left out whole (the file is cut
    back to its last complete line) and said once on `stream`: the run goes on, and the
    check before its next checkpoint stops it if the room does not come back.
    """

    def __init__(self, path, stream=None, through=None):
        """through: the global step a resumed run continues from. The records of later
        steps, which an earlier run wrote past its checkpoint before it stopped, are cut
        from the file first (the file replaced whole): those steps run again and write
        their records anew, so the file reads as an uninterrupted run's."""
        self.path, self.stream = path, stream or sys.stderr
        if through is not None and os.path.exists(path):
            with open(path) as f:
                lines = f.readlines()
            kept = [line for line in lines if _global_step(line) <= through]
            if len(kept) < len(lines):
                save_text(path, "".join(kept))
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.lost = 0                       # records left out for want of room

    def write(self, record):
        line = (json.dumps(record) + "\n").encode()
        end = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            if os.write(self.fd, line) != len(line):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            os.ftruncate(self.fd, end)
            self.lost += 1
            if self.lost == 1:
                self.stream.write(f"warning: {self.path}: cannot write ({e.strerror}); records "
                                  f"are left out until there is room\n")
                self.stream.flush()

    def close(self):
        os.close(self.fd)


def _global_step(line):
    """The global step of a metrics.jsonl line; infinity for a torn line (cut with the
    records after it)."""
    try:
        return json.loads(line)["global_step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def read_metrics(path):
    """The records of a metrics.jsonl file, in order (a torn last line is skipped)."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


class StepProgress:
    """Rank 0's training progress. On a terminal a tqdm bar (steps done, ETA) with the
    latest progress text (loss, images/s, ...) beside it, redrawn in place; elsewhere
    (a Slurm log, CI) that text as a plain line with the ETA each time the trainer logs
    (every --log-every steps). `line()` prints a permanent line (epoch summaries)."""

    def __init__(self, total_steps, done_steps=0, stream=None):
        self.stream = stream or sys.stderr
        self.total, self.start_done = total_steps, done_steps
        self.start = time.perf_counter()
        self.bar = tqdm(total=total_steps, initial=done_steps, file=self.stream,
                        dynamic_ncols=True, bar_format="[{bar:24}] {postfix}  ETA {remaining}") \
            if output_is_terminal(self.stream) else None

    @property
    def tty(self):
        return self.bar is not None

    def update(self, done, text=None):
        """`done` steps of the whole run are complete; `text` (loss, images/s, ...) is given
        on the steps the trainer logs."""
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            if text is not None:
                self.bar.set_postfix_str(text)
        elif text is not None:
            elapsed = time.perf_counter() - self.start
            rate = (done - self.start_done) / elapsed if elapsed > 0 else 0.0
            eta = (self.total - done) / rate if rate > 0 else 0.0
            self.stream.write(f"{text}  ETA {tqdm.format_interval(eta)}\n")
            self.stream.flush()

    def line(self, text):
        """A permanent line (epoch summary, evaluation), above the bar."""
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self):
        if self.bar is not None:
            self.bar.close()
