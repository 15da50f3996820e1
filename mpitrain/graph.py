"""A training step's forward + loss and its backward, each captured once as a CUDA graph
and replayed every step after.

Eagerly, a ResNet-50 step queues hundreds of kernels from Python, and the host's time
to queue them can match the GPU's time to run them (docs/design-notes.md). A CUDA
graph records the same kernels, with their arguments and pointers, once; a replay
queues them all with one call. What a replay may not do follows from that:

- read a value from the host that changes from step to step: the images and labels
  are copied into buffers that the graph owns (`x`, `y`), the loss scale is a 0-d
  device array that softmax_cross_entropy multiplies by (`scale`), and each dropout
  layer's mask key is a device array that its kernel reads (Dropout.key), all written
  before each replay. The keys are drawn from the layers' generators as the eager step
  draws them, one per layer and step, so a replay draws the eager step's masks;
- allocate: the kernels write where they wrote while being captured. The capture
  allocates from a memory pool of its own, which lives as long as the graph, and the
  cuDNN workspace of that time is kept too (cuDNN swaps it for a larger one when a
  new shape needs more);
- build a cuDNN plan, compile a kernel or wait for the device: every layer has run
  eagerly before the capture (`eager_steps` steps), which builds and caches all of it.

The update stays outside the graph (the optimizer's learning rate and the overflow
verdict are read on the host, once a step, as PyTorch's GradScaler reads its flag).
Two graphs rather than one keep forward and backward apart, so the step's phases are
timed as in the eager step; the backward graph reads what the forward graph cached.

`refusal(model, ranks)` says why a step cannot be captured (None: it can): on the CPU
there is nothing to capture; with more than one rank, backward's hooks start the
all-reduce of each bucket as it lands, which a replay cannot do; an fp32 model's fully
connected layers multiply through cuBLAS, whose calls CuPy refuses to capture (fp16
products go through cuDNN, kernels/cudnn.py). The eager step serves all of these, and a
capture that fails for another reason (a layer that copies from the host, say) leaves
the step eager and says why; its dropout layers draw their keys in forward again.
"""
import numpy as np

from mpitrain import backend


def refusal(model, ranks=1, device=None):
    """Why `model`'s step on `ranks` ranks runs eagerly (None: it can be captured).
    device: where it runs (default: backend.device)."""
    from mpitrain.nets.linear import Linear
    if (device or backend.device) == "cpu":
        return "the step runs on the CPU (CUDA graphs are a GPU's)"
    if ranks > 1:
        return (f"{ranks} ranks: each bucket's all-reduce starts from backward as its "
                f"gradients land, which a replay cannot do")
    if model.dtype != np.float16 and any(isinstance(m, Linear) for _, m in model.named_modules()):
        return (f"{model.dtype} fully connected layers multiply through cuBLAS, whose calls "
                f"CuPy does not capture (fp16 models can be)")
    return None


class StepGraph:
    """forward + softmax cross-entropy, and backward, of `model` as two CUDA graphs.

    forward(x, y, scale) -> the loss (a 0-d device array, updated by each replay);
    backward() -> None: the gradients are in model.arena.grad, scale times the loss's.
    correct: None, or an int64 (1,) device array to which every forward, eager or
    replayed, adds how many of its images have their label as the top logit (the
    logits never leave the graph; train_step's `correct`).
    The first `eager_steps` calls run eagerly (and build every plan); the next one
    captures, then replays, as does every later one. From the capture on, the graph
    draws the model's dropout keys before each replay (Dropout.key_drawn_ahead). Every
    batch has the first one's shape. say: where to print the capture's outcome (None:
    nowhere).
    """

    def __init__(self, model, label_smoothing=0.0, eager_steps=2, say=None, correct=None):
        import cupy

        from mpitrain.nets.activation import Dropout
        self.cupy, self.model, self.label_smoothing = cupy, model, label_smoothing
        self.eager_steps, self.say, self.correct = eager_steps, say, correct
        self.steps = 0
        # capture needs a stream of its own (not the legacy default stream); the replays
        # run on the caller's current stream, in order with the rest of the step
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.scale = cupy.ones((), cupy.float32)
        self.x = self.y = None
        self.graphs = self.pool = self.workspace = None
        self.loss = self.dlogits = None
        self.refused = None         # why a capture failed, and the step stays eager
        # the layers whose mask keys this graph draws, from the capture on
        self.dropouts = [m for _, m in model.named_modules() if isinstance(m, Dropout) and m.p > 0]
        self._keys_drawn_ahead(False)   # until this graph captures (an earlier one may have)

    @property
    def captured(self):
        return self.graphs is not None

    def forward(self, x, y, scale):
        xp = self.cupy
        if self.x is None:
            self.x = xp.empty(x.shape, x.dtype)     # (N, H, W, 3), the model's dtype
            self.y = xp.empty(y.shape, y.dtype)     # (N,)
        if (x.shape, x.dtype, y.shape) != (self.x.shape, self.x.dtype, self.y.shape):
            raise ValueError(f"a step graph takes batches of one shape: {self.x.shape} "
                             f"{self.x.dtype} images first, now {x.shape} {x.dtype}")
        self.x[...] = xp.asarray(x)
        self.y[...] = xp.asarray(y)
        self.scale.fill(scale)
        self.steps += 1
        if self.steps > self.eager_steps and not self.captured and self.refused is None:
            self._capture()                 # draws this step's keys
        elif self.captured:
            self._draw_keys()
        if self.captured:
            self.graphs[0].launch(stream=self.cupy.cuda.get_current_stream())
        else:
            self._forward()
            if self.refused is not None:    # the failed capture's keys served this step;
                self._keys_drawn_ahead(False)   # forward draws them from now on
        return self.loss

    def backward(self):
        if self.captured:
            self.graphs[1].launch(stream=self.cupy.cuda.get_current_stream())
        else:
            self.model.backward(self.dlogits)

    def _forward(self):
        from mpitrain.nets.losses import accuracy_counts, softmax_cross_entropy
        logits = self.model.forward(self.x, train=True)
        self.loss, self.dlogits = softmax_cross_entropy(
            logits, self.y, label_smoothing=self.label_smoothing, scale=self.scale)
        if self.correct is not None:    # in place: a replay adds into the same array
            self.correct += accuracy_counts(logits, self.y, topk=(1,))

    def _draw_keys(self):
        """Each dropout layer's next key into its device buffer, where the graphs' kernels
        read it: a copy from the host, so never inside a capture, which would keep it."""
        for layer in self.dropouts:
            layer.draw_key(self.cupy)

    def _keys_drawn_ahead(self, ahead):
        """Whether the dropout layers leave their keys to this graph (else forward draws)."""
        for layer in self.dropouts:
            layer.key_drawn_ahead = ahead

    def _capture(self):
        """Draw this step's dropout keys, then record both graphs (nothing runs: the caller
        launches them). A capture that fails leaves the step eager, with the reason in
        `refused`."""
        from mpitrain.kernels import cudnn
        cp = self.cupy
        self._keys_drawn_ahead(True)
        self._draw_keys()
        # the eager steps' spare blocks go back to the device first: the capture's pool
        # holds a second copy of the step's activations
        cp.get_default_memory_pool().free_all_blocks()
        workspace = cudnn.workspace()
        pool, graphs = cp.cuda.MemoryPool(), []
        try:
            with cp.cuda.using_allocator(pool.malloc), self.stream:
                for phase in (self._forward, lambda: self.model.backward(self.dlogits)):
                    self.stream.begin_capture()
                    try:
                        phase()
                    except BaseException:
                        self._abandon_capture()
                        raise
                    graphs.append(self.stream.end_capture())
        except Exception as e:
            self.refused = f"the capture failed ({type(e).__name__}: {e})"
            self._say(f"CUDA graphs: {self.refused}; the step runs eagerly")
            return
        # the workspace the capture began with, and a larger one, should it have made one
        self.graphs, self.pool, self.workspace = graphs, pool, (workspace, cudnn.workspace())
        self._say(f"CUDA graphs: captured at step {self.steps}, "
                  f"{pool.total_bytes() / 2**20:,.0f} MiB of their own memory")

    def _say(self, line):
        if self.say is not None:
            self.say(line, flush=True)

    def _abandon_capture(self):
        """End a capture that an error interrupted; the error itself is what is reported."""
        try:
            self.stream.end_capture()
        except Exception:           # the capture was already invalid: nothing to keep
            pass
