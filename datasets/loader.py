"""The pipelined loader: a sharded per-epoch sampler, background workers, a ring of batches.

Sharding (ShardedSampler). Epoch e's order is the permutation drawn from
(seed, e): the same on every rank without any communication. Step s takes
the global batch perm[s*B:(s+1)*B] and rank r its contiguous share
[r*b:(r+1)*b] of it (b = B / size). With drop_last (the training default)
there are N // B steps and the last N mod B samples of each epoch's
permutation are not seen in that epoch (a different few every epoch); without
it there are ceil(N / B) steps and the permutation is padded by repeating its
start, as PyTorch's DistributedSampler does, so a few samples count twice.
Either way every rank takes the same number of steps.

Pipeline (Loader). Workers (threads: Pillow and NumPy release the GIL while
decoding, resizing and normalising; each opens its own h5py handle) fill a
ring of prefetch+1 batch buffers that are allocated once. A batch is split into
one chunk of images per worker, and the chunks are handed out in order, so the
workers cooperate on the next batch and run up to `prefetch` batches ahead of
the step, across epoch boundaries. The consumer gets (x, y) views of a ring slot;
the slot is handed back to the workers when the consumer asks for the next
batch, so a view is valid until then. An exception in a worker is re-raised
in the consumer: the pipeline never hangs on a bad record.

Augmentation is drawn from a generator seeded by (seed, epoch, index), so the
data of a step does not depend on the number of workers or on timing, and a
resumed run sees the same images as an uninterrupted one.

Decoding on the GPU (decode="gpu"). The ring's batches are device arrays; a worker
reads its chunk's records on the host, then decodes them together with nvImageCodec
and crops, resizes and normalises them in one kernel (batch_augment.py), all on a
CUDA stream of its own, and records an event. The consumer's stream waits for the
events of a batch before the step reads it, and a worker waits, on its stream, for
the event the consumer recorded when it handed the slot back, so a slot is not
overwritten while a step still reads it. A worker's host thread waits for nothing on
the device: nvImageCodec's pixels are read on the stream they were decoded on.
"""
import threading
import time

import numpy as np

from .augment import RATIO, SCALE, Augment
from .batch_augment import BatchAugment
from .h5format import Reader, white_level


class DataError(RuntimeError):
    """A record that cannot be read or decoded; the message names the file and the index."""


class ShardedSampler:
    """This rank's indices of each step of each epoch (see the module docstring).

    Iterating yields (local_batch,) index arrays from the current (epoch, step)
    to the end of that epoch, then moves to the next epoch. `state_dict()` and
    `load_state_dict()` save and restore the position.
    """

    def __init__(self, num_samples, global_batch, rank, size, seed=0, drop_last=True,
                 shuffle=True):
        if global_batch % size:
            raise ValueError(f"global batch {global_batch} does not divide by {size} ranks")
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside 0..{size - 1}")
        self.num_samples, self.global_batch = num_samples, global_batch
        self.rank, self.size, self.seed = rank, size, seed
        self.local_batch = global_batch // size
        self.drop_last, self.shuffle = drop_last, shuffle
        if drop_last:
            self.steps = num_samples // global_batch
            if self.steps == 0:
                raise ValueError(f"{num_samples} samples make no full global batch of "
                                 f"{global_batch}; lower the batch size or use drop_last=False")
        else:
            self.steps = -(-num_samples // global_batch)
        self.epoch, self.step = 0, 0

    def __len__(self):
        return self.steps

    def permutation(self, epoch):
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def epoch_indices(self, epoch):
        """(steps, local_batch) int64: this rank's indices for every step of `epoch`."""
        order = np.resize(self.permutation(epoch), self.steps * self.global_batch)
        return order.reshape(self.steps, self.size, self.local_batch)[:, self.rank]

    def __iter__(self):
        indices = self.epoch_indices(self.epoch)
        while self.step < self.steps:
            self.step += 1
            yield indices[self.step - 1]
        self.epoch, self.step = self.epoch + 1, 0

    def state_dict(self):
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state):
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        if not 0 <= self.step <= self.steps:
            raise ValueError(f"step {self.step} outside 0..{self.steps}")


class Loader:
    """Batches (x, y) of one split for one rank: x (local_batch, image_size,
    image_size, 3) in `dtype`, normalised; y (local_batch,) int64.

    `for x, y in loader:` runs one epoch from the current position. Training
    (train=True) shuffles, drops the remainder and augments (random-resized-crop
    with `scale`, flip if `flip`); validation keeps file order, pads the last
    step and applies resize + centre crop with `crop_fraction`. `augment`,
    `shuffle` and `drop_last` override those defaults one by one.

    The file's schema is checked on opening (labels against `num_classes`).
    A record that fails to read or decode raises DataError naming its index; with
    skip_bad_records it is replaced by the next record in file order that
    decodes, and counted in `skipped` when its batch is handed out (`bad_indices`
    lists them).

    Without drop_last, `last_valid` says how many leading entries of the last
    batch are real samples (the rest pad the last step), so an evaluation can
    score x[:last_valid] and count every sample exactly once. `last_stand_in` marks
    the rows of the batch where the next good record stands in for a bad one
    (skip_bad_records), which an evaluation leaves out.

    workers=0 does the work in the consumer (no threads). `wait_time` is the
    total time the consumer has waited for data (with workers=0: spent loading
    it), `last_wait` that of the last batch. Call `close()` (or use `with`) to
    stop the workers. normalise: the model's normalisation {mean, std, pixel_max}, used
    in place of the file's own (in_units_of). `pinned=True` allocates the ring in
    page-locked host memory (CuPy), so the trainer can copy it to the GPU asynchronously;
    such a copy reads the slot when the GPU reaches it, so a worker refills a handed-back
    slot only after the event the consumer recorded at its hand-back. decode="gpu": the
    ring is on the current GPU and the workers decode there (see the module docstring).
    """

    def __init__(self, path, global_batch, rank=0, size=1, train=True, image_size=224,
                 workers=2, prefetch=2, dtype=np.float32, seed=0, skip_bad_records=False,
                 num_classes=None, augment=None, shuffle=None, drop_last=None,
                 scale=SCALE, ratio=RATIO, crop_fraction=0.875, flip=True, pinned=False,
                 decode="cpu", normalise=None):
        with Reader(path, num_classes) as reader:
            self.labels = reader.labels
            self.class_names = reader.class_names
            self.mean, self.std = in_units_of(reader, normalise)
        self.path = path
        self.num_classes = len(self.class_names) if num_classes is None else num_classes
        self.sampler = ShardedSampler(len(self.labels), global_batch, rank, size, seed,
                                      drop_last=train if drop_last is None else drop_last,
                                      shuffle=train if shuffle is None else shuffle)
        self.local_batch = self.sampler.local_batch
        self.steps_per_epoch = self.sampler.steps
        self.augment = Augment(image_size, self.mean, self.std,
                               train=train if augment is None else augment, scale=scale,
                               ratio=ratio, crop_fraction=crop_fraction, flip=flip)
        self.seed, self.workers, self.skip_bad_records = seed, workers, skip_bad_records
        self.ring = prefetch + 1
        shape = (self.ring, self.local_batch, image_size, image_size, 3)
        self.device = None
        # the event of each slot's hand-back, where the device reads the ring: the slot is
        # filled again once the work queued before it (the step, or the copy of a
        # page-locked batch, which runs when the device gets to it) is done
        self._freed = [None] * self.ring if decode == "gpu" or pinned else None
        if decode == "gpu":
            import cupy
            self.device = cupy.cuda.Device()
            self.x = cupy.empty(shape, dtype)
            self._filled = [[] for _ in range(self.ring)]   # each chunk's event
            self._local = threading.local()      # each worker's stream and batch decoder
            # every worker's (stream, BatchAugment), kept as long as the loader: an image
            # decoded on a stream is freed on it, maybe after its worker has ended
            self._decoders = []
        else:
            self.x = _empty(shape, dtype, pinned)
        self.y = np.zeros((self.ring, self.local_batch), np.int64)
        # the rows of each slot that hold the next good record in place of a bad one
        self.stand_in = np.zeros((self.ring, self.local_batch), bool)
        self.chunk = -(-self.local_batch // max(workers, 1))
        self.chunks = -(-self.local_batch // self.chunk)
        self.wait_time = self.last_wait = 0.0
        self.last_valid = 0
        self.skipped, self.bad_indices = 0, set()
        # bad records met while filling each ring slot; added to `skipped` when the batch is
        # handed out, so batches prefetched but never consumed do not count
        self._slot_bad = [0] * self.ring
        self._next = 0            # absolute number (epoch * steps + step) of the next batch
        self._threads = []
        self._epochs = {}         # epoch -> this rank's indices, for the epochs in flight
        self._lock = threading.Lock()   # guards _epochs, _slot_bad, bad_indices

    # -- position -------------------------------------------------------------
    def __len__(self):
        return self.steps_per_epoch

    @property
    def epoch(self):
        return self._next // self.steps_per_epoch

    def state_dict(self):
        """Position of the next batch to be consumed: {"epoch", "step"}."""
        return {"epoch": self._next // self.steps_per_epoch,
                "step": self._next % self.steps_per_epoch}

    def load_state_dict(self, state):
        self.close()
        self.sampler.load_state_dict(state)
        self._next = self.sampler.epoch * self.steps_per_epoch + self.sampler.step

    # -- consumer -------------------------------------------------------------
    def __iter__(self):
        """The remaining batches of the current epoch."""
        end = (self.epoch + 1) * self.steps_per_epoch
        if self.workers == 0:
            with Reader(self.path, check=False) as reader:
                while self._next < end:
                    a = self._next
                    self._release_device(a)
                    start = time.perf_counter()
                    self._slot_bad[a % self.ring] = 0
                    self._fill(reader, a, 0, self.local_batch)
                    self.last_wait = time.perf_counter() - start
                    self.wait_time += self.last_wait
                    self._next = a + 1
                    self.last_valid = self._valid(a)
                    self.last_stand_in = self.stand_in[a % self.ring]
                    self.skipped += self._slot_bad[a % self.ring]
                    self._hand_over_device(a % self.ring)
                    yield self.x[a % self.ring], self.y[a % self.ring]
            return
        while self._next < end:
            self._start()
            a = self._next
            k = a % self.ring
            start = time.perf_counter()
            self._release_device(a)
            with self._cond:
                self._held = a                  # hands the previous batch's slot back
                self._cond.notify_all()
                # a worker's failure on a later batch leaves this one to the others
                while not self._ready(a) and not self._failed_by(a):
                    self._cond.wait()
                ready = self._ready(a)
            if not ready:                       # a worker failed; this batch will never come
                self.close()
                raise self._error
            self.last_wait = time.perf_counter() - start
            self.wait_time += self.last_wait
            self._next = a + 1
            self.last_valid = self._valid(a)
            self.last_stand_in = self.stand_in[k]
            self.skipped += self._slot_bad[k]
            self._hand_over_device(k)
            yield self.x[k], self.y[k]

    def _release_device(self, a):
        """Before batch a is asked for: the slot of batch a - 1 is free once the work the
        consumer has queued so far (the step that read it) is done."""
        if self._freed is not None:
            import cupy
            with self._lock:
                self._freed[(a - 1) % self.ring] = cupy.cuda.get_current_stream().record()

    def _hand_over_device(self, k):
        """The consumer's stream waits for the chunks of slot k."""
        if self.device is not None:
            import cupy
            with self._lock:
                events, self._filled[k] = self._filled[k], []
            stream = cupy.cuda.get_current_stream()
            for event in events:
                stream.wait_event(event)

    @property
    def host_decoded(self):
        """With decode="gpu": how many records the GPU's decoder left to the host's (other
        formats than JPEG, CMYK JPEGs, and records nvImageCodec refuses or fails on)."""
        with self._lock:
            return sum(batch.host_decoded for _, batch in self._decoders)

    def _valid(self, a):
        """How many leading entries of batch a are real samples, not padding."""
        first = (a % self.steps_per_epoch) * self.sampler.global_batch \
            + self.sampler.rank * self.local_batch
        return int(np.clip(len(self.labels) - first, 0, self.local_batch))

    def _failed_by(self, a):
        """Whether a worker failed on batch a or before it (so that a never comes)."""
        return self._error is not None and self._error_batch <= a

    def _ready(self, a):
        k = a % self.ring
        return self._slot_batch[k] == a and self._slot_done[k] == self.chunks

    # -- workers ---------------------------------------------------------------
    def _start(self):
        if self._threads:
            return
        self._cond = threading.Condition()
        self._stop = False
        self._error, self._error_batch = None, None
        self._held = self._next
        self._task = (self._next, 0)
        self._slot_batch = [-1] * self.ring
        self._slot_done = [0] * self.ring
        self._threads = [threading.Thread(target=self._work, name=f"loader-{i}", daemon=True)
                         for i in range(self.workers)]
        for t in self._threads:
            t.start()

    def close(self):
        """Stop the workers (they restart on the next iteration)."""
        if not self._threads:
            return
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()
        self._threads = []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _work(self):
        reader, a = None, -1                            # a: the batch this worker fills
        try:
            reader = Reader(self.path, check=False)     # this worker's own h5py handle
            while True:
                with self._cond:
                    # a batch may be filled once the batch `ring` places before it is handed back
                    while not self._stop and self._task[0] >= self._held + self.ring:
                        self._cond.wait()
                    if self._stop:
                        return
                    a, c = self._task
                    self._task = (a, c + 1) if c + 1 < self.chunks else (a + 1, 0)
                    if c == 0:
                        self._slot_batch[a % self.ring] = a
                        self._slot_done[a % self.ring] = 0
                        self._slot_bad[a % self.ring] = 0
                lo = c * self.chunk
                self._fill(reader, a, lo, min(lo + self.chunk, self.local_batch))
                with self._cond:
                    self._slot_done[a % self.ring] += 1
                    self._cond.notify_all()
        except BaseException as e:          # handed to the consumer, which raises it
            with self._cond:
                if self._error is None or a < self._error_batch:   # the earliest batch
                    self._error, self._error_batch = e, a
                self._cond.notify_all()
        finally:
            if reader is not None:
                reader.close()

    def _indices(self, epoch):
        with self._lock:
            if epoch not in self._epochs:
                for old in [e for e in self._epochs if e < epoch - 1]:
                    del self._epochs[old]
                self._epochs[epoch] = self.sampler.epoch_indices(epoch)
            return self._epochs[epoch]

    def _fill(self, reader, a, lo, hi):
        """Images lo..hi-1 of absolute batch a into its ring slot."""
        epoch, step = divmod(a, self.steps_per_epoch)
        k = a % self.ring
        indices = self._indices(epoch)[step]
        if self.device is not None:
            self._fill_device(reader, epoch, indices[lo:hi], k, lo, hi)
            return
        if self._freed is not None:             # page-locked: its copy to the GPU has run
            with self._lock:
                freed = self._freed[k]
            if freed is not None:
                freed.synchronize()
        for j in range(lo, hi):
            i = int(indices[j])
            r = self._load(reader, i, epoch, self.x[k, j], k)
            self.y[k, j], self.stand_in[k, j] = self.labels[r], r != i

    def _fill_device(self, reader, epoch, indices, k, lo, hi):
        """The records of `indices` decoded and augmented together on this worker's
        stream into rows lo..hi-1 of slot k, after the slot's previous batch was read."""
        import cupy
        local = self._local
        if not hasattr(local, "stream"):
            self.device.use()                   # CuPy's current device is per thread
            local.stream = cupy.cuda.Stream(non_blocking=True)
            local.batch = BatchAugment(self.augment)
            with self._lock:
                self._decoders.append((local.stream, local.batch))
        with self._lock:
            freed = self._freed[k]
        with local.stream:
            records, rngs, rs, images = self._decoded(
                reader, epoch, indices, k, lambda batch: local.batch.decode(batch, cupy))
            self.y[k, lo:hi], self.stand_in[k, lo:hi] = self.labels[rs], rs != indices
            if freed is not None:               # the decode wrote buffers of its own
                local.stream.wait_event(freed)
            local.batch(records, rngs, self.x[k, lo:hi], images)
            event = local.stream.record()
        with self._lock:
            self._filled[k].append(event)

    def _decoded(self, reader, epoch, indices, slot, decode):
        """The records of `indices` decoded together by `decode` (a list of records to a
        list of pixels, None for a record that does not decode), a bad one replaced as
        _load replaces it: (records, their generators, their indices, their pixels)."""
        def alone(r):
            pixels = decode([reader.record(r)])[0]
            if pixels is None:
                raise ValueError("the batch decoder cannot decode it")
            return pixels

        rs = [int(i) for i in indices]
        records = [reader.record(r) for r in rs]
        images = decode(records)
        for j in range(len(rs)):
            if images[j] is None:
                rs[j], images[j] = self._first_good(rs[j], slot, alone)
                records[j] = reader.record(rs[j])
        rngs = [np.random.default_rng([self.seed, epoch, r]) for r in rs]
        return records, rngs, np.array(rs), images

    def _load(self, reader, i, epoch, out, slot):
        """Decode and augment record i into out (in ring slot `slot`); returns the record
        that is there: i, or the one that stands in for it."""
        r, _ = self._first_good(i, slot, lambda r: self.augment(
            reader.record(r), out, np.random.default_rng([self.seed, epoch, r])))
        return r

    def _first_good(self, i, slot, attempt):
        """(r, attempt(r)) for the first record r of i, i + 1, ... (in file order, round
        the end) on which attempt does not raise. A record it raises on is a DataError
        without skip_bad_records; with it, the record is counted for ring slot `slot`
        and the next one tried, up to 100."""
        n = len(self.labels)
        for tries in range(min(n, 100)):
            r = (i + tries) % n
            try:
                return r, attempt(r)
            except Exception as e:
                if not self.skip_bad_records:
                    # the loader of preview and bench data too, which skip none
                    raise DataError(f"{self.path}: record {r} cannot be decoded "
                                    f"({type(e).__name__}: {e}); train and eval skip such "
                                    f"records with --skip-bad-records (each counted and "
                                    f"reported)") from e
                with self._lock:
                    self._slot_bad[slot] += tries == 0      # one per record replaced
                    self.bad_indices.add(r)
        raise DataError(f"{self.path}: records {i}..{r} are all bad; giving up")


def in_units_of(reader, normalise=None):
    """The (mean, std) that a file's pixels are normalised with: the file's own, or the
    model's `normalise` {mean, std, pixel_max} (its training file's) where given, in this
    file's pixel units. A model is scored on the normalisation it was trained with, not
    on that of the file scored (a test set converted apart has statistics of its own)."""
    if normalise is None:
        return reader.mean, reader.std
    mean = np.asarray(normalise["mean"], np.float64)
    std = np.asarray(normalise["std"], np.float64)
    if np.array_equal(mean, reader.mean) and np.array_equal(std, reader.std):
        return reader.mean, reader.std
    scale = white_level(reader) / float(normalise.get("pixel_max", 255.0))
    return mean * scale, std * scale


def pinned_for(xp, decode):
    """Whether a loader feeding a step on the array module xp keeps its ring in page-locked
    memory: batches decoded on the host for a GPU, so that their copies run asynchronously."""
    return xp is not np and decode == "cpu"


def _empty(shape, dtype, pinned):
    if pinned:
        import cupyx
        return cupyx.empty_pinned(shape, dtype)
    return np.empty(shape, dtype)
