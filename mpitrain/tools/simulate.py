"""`python -m mpitrain simulate`: a latency-bandwidth (α-β) model of data-parallel training.

It predicts the step time of N ranks (K per node) from three things:

  1. the model's real gradient buckets: the arena built from mpitrain.nets and cut by
     mpitrain.comm.buckets.bucket_bounds at the fusion threshold, exactly as training
     cuts it (`gradient_buckets`);
  2. the compute time of one step on one device, from its published single-device
     training throughput (DEVICES; sources in docs/scaling.md) scaled by the network's
     forward multiply-adds (`mpitrain.tools.inspect.layer_table`);
  3. the time of each all-reduce algorithm on each bucket, from the α-β formulas below,
     with separate links inside a node (NVLink, PCIe, shared memory) and between nodes
     (the network, --network Gbit/s per node).

The collectives. A link takes α seconds per message step plus β seconds per byte
(1/β is its bandwidth as NCCL's "bus bandwidth" reports it). n bytes, p ranks in m
nodes of K:

    ring all-reduce     ring(p, n)       = 2(p-1) α + 2(p-1)/p n β
                        (reduce-scatter then all-gather, each p-1 steps of n/p)
    reduce-scatter      rs(K, n)         = (K-1) α + (K-1)/K n β
    all-gather          ag(K, n)         = (K-1) α + (K-1)/K n β
    reduce, broadcast   chain(K, n)      = (K-1) α + n β
                        (pipelined along a chain: n crosses every link once)
    halving-doubling    tree(p, n)       = 2 ceil(log2 p) α + 2(p-1)/p n β
                        (Rabenseifner's all-reduce, which MPI libraries run for large
                        buffers; NCCL's double binary trees cost about the same)

The algorithms (mpitrain/comm/algorithms.py), intra = the node's link, net = the network,
and ring_net below is tree_net under --across tree:

    flat          one ring through all p ranks. With m > 1 every step waits for its
                  slowest hop, a network one:
                  ring(p, n) with α = max(α_intra, α_net), β = max(β_intra, β_net)
                  (on one node: ring_intra(p, n)). Under --across tree, tree(p, n) with
                  β = max(β_intra, K β_net): its long-distance steps send the traffic of
                  all K ranks of a node through the node's link at once, where a ring
                  crosses it once.
    hierarchical  Jia et al.: reduce to the node leader, all-reduce among the m leaders,
                  broadcast in the node:
                  chain_intra(K, n) + ring_net(m, n) + chain_intra(K, n)
    2d            reduce-scatter in the node, all-reduce of each 1/K shard among the ranks
                  with the same local index, all-gather in the node. The K shard rings
                  share the node's network link, so together they move n bytes through it:
                  rs_intra(K, n) + ring_net(m, n) + ag_intra(K, n)
                  (Mikami et al.'s 2D torus is this with the node as one torus dimension)
    shm           (CPU hosts) 2d with the node phases in shared memory: two barriers,
                  and each of the K ranks reads its shard of all K copies and writes the
                  sum into all K (2n bytes per rank, 2Kn through the node's memory):
                  2 α_intra + 2 K n β_intra + ring_net(m, n)
    hybrid        per bucket, the fastest of the above by this model: Jia et al.'s switch
                  between algorithms by tensor size and cluster size.

The latency term 2(p-1)α is what hierarchical and 2d cut: the flat ring's 2(p-1)
steps become 2(m-1) network steps, K times fewer. Their bandwidth through the
network is the same as the ring's. Float16 on the wire halves n (the casts cost
nothing on a GPU; on a CPU host their cost is not modelled). The reduction's own
arithmetic (γ per byte) is folded into β: on GPUs it runs at memory speed, on this
host the fit of `--calibrate` absorbs it.

The step. Compute time per rank for a batch of B images is
B * MACs(model) / R, with R the device's rate in forward multiply-adds per second
(its ResNet-50 images/s times ResNet-50's MACs at 224x224); forward takes 1/3 of it
and backward 2/3 (two GEMMs per layer against one; the update is folded into the
published throughput). On a CPU host of C cores, p ranks share it: without a
calibration each gets 1/p of the host's rate. A calibration measures the sharing
instead: the rate of one process of max(1, C // p) threads while p such processes
run the step at once (memory bandwidth and caches shared, and beyond C ranks the
cores taken in turns); for a rank count it did not measure, the rate measured for
max(1, C // p) threads alone, times min(1, C / p).

Overlap. Backward produces the gradients in arena order; a layer's gradients are
ready once backward has done its share of the work (its forward MACs over the
whole network's), so bucket b is ready at r_b = forward + backward * (work of the
layers from the last down to the earliest with a parameter in b). One stream sums the
buckets in order:

    start_b = max(r_b, end_{b-1}),   end_b = start_b + T(b)
    exposed = max(0, end_last - (forward + backward))

Without overlap, exposed = sum of T(b). Step = forward + backward + exposed + update.
Scaling efficiency = step(1 rank) / step(N ranks): the N-rank throughput over N
times one rank's at the same per-rank batch.

`--calibrate` replaces the guesses by measurements on this host: it runs the step
of 1 to 4 concurrent processes without communication (`bench step`, the compute),
`bench comm` for 2 to 4 ranks, fits α and β of every algorithm by least squares over
bench comm's buffer sizes, and prints the predicted step and all-reduce times beside
those of `bench step` under mpirun (docs/scaling.md). Its all-reduce is the time on
the rank that reached it last, which waits for no other rank's backward: the model
has no term for a slower rank's skew, and the step's time includes it.
"""
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from mpitrain.files import output_problem, save_json, save_text

GBIT = 1e9 / 8                      # bytes per second in one Gbit/s
IMAGENET_IMAGES = 1_281_167         # ImageNet-1k training images
# forward multiply-adds of one ResNet-50 image at 224x224, as `python -m mpitrain inspect
# --model resnet50` counts them (tests/test_simulate.py checks the count); the published
# throughputs are ResNet-50's, other networks are scaled by their own count
RESNET50_MACS = 4_089_184_256
FORWARD_SHARE = 1 / 3               # of the compute of a step; backward takes the rest
ALGORITHMS = ("flat", "hierarchical", "2d", "shm")


# ----------------------------------------------------------------------------
# Links, devices
# ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """alpha: seconds per message step; beta: seconds per byte (1 / bandwidth)."""
    alpha: float
    beta: float

    @classmethod
    def of(cls, latency_us, bytes_per_s):
        return cls(latency_us * 1e-6, 1.0 / bytes_per_s)


@dataclass(frozen=True)
class Device:
    """One rank's device: its ResNet-50 training rate and the link between the devices of
    a node. cores: CPU hosts only, the cores the host's ranks share."""
    name: str
    resnet50_images_per_s: float
    source: str
    link: Link
    link_source: str
    ranks_per_node: int
    cores: int = 0
    links: dict = field(default_factory=dict)     # algorithm -> Link, where they differ

    def node_link(self, algorithm):
        return self.links.get(algorithm, self.link)

    def macs_per_s(self):
        """Forward multiply-adds per second of training (a whole host for a CPU)."""
        return self.resnet50_images_per_s * RESNET50_MACS


DEVICES = {
    "p40": Device("Tesla P40 (fp32 math)", 200.0,
                  "estimate: 11.8 TFLOP/s fp32 peak (P40 datasheet) at ~40% of peak, the share "
                  "P100/V100 reach in fp32, over 23 GFLOP per ResNet-50 training image",
                  Link.of(10, 10e9), "PCIe 3.0 x16 through the host, ~10 GB/s bus bandwidth", 8),
    "v100": Device("Tesla V100 SXM2 (mixed precision)", 1200.0,
                   "NVIDIA DeepLearningExamples, PyTorch ConvNets resnet50v1.5, AMP, 1 GPU",
                   Link.of(5, 130e9), "NVLink 2, ~130 GB/s NCCL bus bandwidth (DGX-1)", 8),
    "a100": Device("A100 80GB SXM (mixed precision)", 2470.0,
                   "NVIDIA DeepLearningExamples, PyTorch ConvNets resnet50v1.5, AMP, 1 GPU",
                   Link.of(5, 230e9), "NVLink 3 + NVSwitch, ~230 GB/s NCCL bus bandwidth", 8),
    "h100": Device("H100 SXM (mixed precision)", 7160.0,
                   "MLPerf Training v4.0 ResNet-50, 8 GPUs, batch 400 per GPU (MXNet + DALI)",
                   Link.of(5, 360e9), "NVLink 4 + NVSwitch, ~360 GB/s NCCL bus bandwidth", 8),
    "cpu": Device("this host's CPU (2 cores, mpitrain)", 4.3,
                  "docs/benchmarks.md: mpitrain ResNet-50 224x224 batch 8, one process x 2 "
                  "threads; `simulate --calibrate` measures it again",
                  Link.of(5, 4e9), "MPICH shared memory, ~4 GB/s bus bandwidth for flat "
                  "(docs/benchmarks.md); shm ~60 GB/s of memory traffic", 2, cores=2,
                  links={"shm": Link.of(20, 60e9)}),
}
GPU_ALGORITHMS = ("flat", "hierarchical", "2d")     # shm is the CPU hosts' shared memory


def algorithms_of(device):
    return ALGORITHMS if device.cores else GPU_ALGORITHMS


# ----------------------------------------------------------------------------
# The collectives
# ----------------------------------------------------------------------------
def ring(p, n, link):
    """Ring all-reduce of n bytes over p ranks: 2(p-1) α + 2(p-1)/p n β."""
    return 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * n * link.beta if p > 1 else 0.0


def halving_doubling(p, n, link):
    """Rabenseifner's all-reduce (recursive-halving reduce-scatter, recursive-doubling
    all-gather), also the cost shape of NCCL's double binary trees:
    2 ceil(log2 p) α + 2(p-1)/p n β."""
    return 2 * math.ceil(math.log2(p)) * link.alpha + 2 * (p - 1) / p * n * link.beta \
        if p > 1 else 0.0


ACROSS = {"ring": ring, "tree": halving_doubling}


def reduce_scatter(k, n, link):
    """(k-1) α + (k-1)/k n β; all-gather costs the same."""
    return (k - 1) * link.alpha + (k - 1) / k * n * link.beta if k > 1 else 0.0


def chain(k, n, link):
    """Pipelined reduce or broadcast of n bytes along k ranks: (k-1) α + n β."""
    return (k - 1) * link.alpha + n * link.beta if k > 1 else 0.0


def allreduce_time(algorithm, n, p, k, intra, net, across="ring"):
    """Seconds to sum n bytes over p ranks in nodes of k (the last node may hold fewer
    when p < k), with the node's link `intra` and the network `net` (module docstring).
    across: the all-reduce that spans nodes, "ring" or "tree" (halving_doubling)."""
    if p <= 1:
        return 0.0
    k = min(k, p)
    m = math.ceil(p / k)
    allreduce = ACROSS[across]
    if algorithm == "flat":
        if m == 1:
            return ring(p, n, intra)
        # a ring crosses each node's network link once; halving-doubling sends all k ranks'
        # traffic through it at once
        shared = net.beta * (k if across == "tree" else 1)
        return allreduce(p, n, Link(max(intra.alpha, net.alpha), max(intra.beta, shared)))
    if algorithm == "hierarchical":
        return 2 * chain(k, n, intra) + allreduce(m, n, net)
    if algorithm == "2d":
        return 2 * reduce_scatter(k, n, intra) + allreduce(m, n, net)
    if algorithm == "shm":
        node = 2 * intra.alpha + 2 * k * n * intra.beta if k > 1 else 0.0
        return node + allreduce(m, n, net)
    raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")


def coefficients(algorithm, n, p):
    """(a, b) with allreduce_time(algorithm, n, p, p, Link(α, β), ·) = a α + b β on one node:
    what `fit_link` solves for."""
    one = allreduce_time(algorithm, n, p, p, Link(1.0, 0.0), Link(0.0, 0.0))
    per_byte = allreduce_time(algorithm, n, p, p, Link(0.0, 1.0), Link(0.0, 0.0))
    return one, per_byte


# ----------------------------------------------------------------------------
# The model's gradients and work
# ----------------------------------------------------------------------------
@dataclass
class Workload:
    """What one step of `model` asks of a rank: its buckets (elements of the arena in
    each, parameters in each, and the share of backward done when each is ready) and
    its forward multiply-adds per image."""
    model: str
    image_size: int
    threshold: int
    bounds: list            # bucket_bounds(arena, threshold)
    elements: np.ndarray    # arena elements per bucket (padding inside a bucket included)
    params: np.ndarray      # parameter values per bucket
    ready: np.ndarray       # share of backward done when the bucket is complete
    macs: int               # forward multiply-adds per image
    tensors: int

    def bucket_bytes(self, itemsize):
        return self.elements * itemsize


def gradient_buckets(model_name, threshold, image_size=224, num_classes=1000):
    """The Workload of `model_name`: its arena cut by bucket_bounds, and each bucket's
    readiness from the layers' forward MACs (mpitrain.tools.inspect.layer_table, one forward
    pass of one image)."""
    from mpitrain.comm.buckets import bucket_bounds
    from mpitrain.tools.inspect import layer_table
    rows, model = layer_table(model_name, image_size, num_classes)
    arena = model.arena
    bounds = bucket_bounds(arena, threshold)
    # backward runs the layers from the last; a layer's gradients are ready once the work
    # of the layers from the last one down to it is done
    work = np.array([r[4] for r in rows], np.float64)
    done_after = np.cumsum(work[::-1])[::-1] / max(work.sum(), 1.0)
    done = dict(zip((r[0] for r in rows), done_after))
    starts = np.array([a for a, _ in bounds])
    ready = np.zeros(len(bounds))
    params = np.zeros(len(bounds), np.int64)
    for p in arena.params:
        b = int(np.searchsorted(starts, p.offset, side="right")) - 1
        params[b] += p.size
        ready[b] = max(ready[b], done[p.name.rsplit(".", 1)[0]])
    elements = np.array([b - a for a, b in bounds], np.int64)
    return Workload(model_name, image_size, threshold, bounds, elements, params, ready,
                    int(work.sum()), len(arena.params))


# ----------------------------------------------------------------------------
# The step
# ----------------------------------------------------------------------------
@dataclass
class Compute:
    """Seconds of forward, backward and update of one rank's step."""
    forward: float
    backward: float
    update: float = 0.0

    @property
    def total(self):
        return self.forward + self.backward + self.update


def exposed_comm(forward, backward, ready, times, overlap):
    """Communication time left after backward: buckets summed in order on one stream,
    bucket b starting when backward has reached it (forward + backward * ready[b]) and
    the previous bucket is done; without overlap, all of it."""
    if not overlap:
        return float(np.sum(times))
    end = forward
    for r, t in zip(ready, times):
        end = max(end, forward + backward * r) + t
    return max(0.0, end - (forward + backward))


@dataclass
class Cluster:
    """p ranks, k per node, of `device`, nodes joined by a network of `net`."""
    device: Device
    ranks: int
    ranks_per_node: int
    net: Link
    calibration: dict = None
    across: str = "ring"

    def node_link(self, algorithm):
        """The node's link for `algorithm`: a calibrated fit at the node's rank count (or
        the nearest fitted one) where there is one, else the device's."""
        fits = (self.calibration or {}).get("links", {}).get(algorithm)
        if not fits:
            return self.device.node_link(algorithm)
        k = min(self.ranks, self.ranks_per_node)
        near = min(fits, key=lambda q: (abs(int(q) - k), -int(q)))
        return Link(fits[near]["alpha"], fits[near]["beta"])

    def compute(self, workload, batch):
        """Compute of one rank's step of `batch` images (module docstring)."""
        macs = batch * workload.macs
        cal = self.calibration
        if cal is None:
            rate = self.device.macs_per_s()
            if self.device.cores:                   # the host's rate shared by its ranks
                rate /= min(self.ranks, self.ranks_per_node)
            return Compute(FORWARD_SHARE * macs / rate, (1 - FORWARD_SHARE) * macs / rate)
        c = cal["compute"]
        per_host = min(self.ranks, self.ranks_per_node)
        rate = c.get("shared_macs_per_s", {}).get(str(per_host))
        if rate is None:
            threads = max(1, c["cores"] // per_host)
            rate = c["macs_per_s"].get(str(threads), c["macs_per_s"]["1"] * threads)
            rate *= min(1.0, c["cores"] / per_host)   # ranks beyond the cores take turns
        f, b, u = c["shares"]
        return Compute(f * macs / rate, b * macs / rate, u * macs / rate)

    def bucket_times(self, algorithm, bucket_bytes):
        algs = algorithms_of(self.device) if algorithm == "hybrid" else (algorithm,)
        times = np.array([[allreduce_time(a, n, self.ranks, self.ranks_per_node,
                                          self.node_link(a), self.net, self.across)
                           for n in bucket_bytes]
                          for a in algs])
        return times.min(axis=0), [algs[i] for i in times.argmin(axis=0)]


def predict(workload, cluster, algorithm, batch, wire_itemsize=4, overlap=True):
    """{comm, exposed, step, compute...} in seconds for one step of `cluster` on
    `workload`, with `algorithm` on every bucket (hybrid: the fastest per bucket)."""
    c = cluster.compute(workload, batch)
    times, chosen = cluster.bucket_times(algorithm, workload.bucket_bytes(wire_itemsize))
    exposed = exposed_comm(c.forward, c.backward, workload.ready, times, overlap)
    step = c.total + exposed
    one = Cluster(cluster.device, 1, cluster.ranks_per_node, cluster.net, cluster.calibration,
                  cluster.across)
    return dict(algorithm=algorithm, ranks=cluster.ranks, forward=c.forward,
                backward=c.backward, update=c.update, comm=float(times.sum()),
                exposed=exposed, step=step, images_per_s=cluster.ranks * batch / step,
                efficiency=one.compute(workload, batch).total / step,
                chosen=sorted(set(chosen)))


def sweep_ranks(ranks_per_node, largest=4096):
    """1, 2, 4, ... up to a node, then whole nodes doubling, up to `largest` ranks."""
    out, p = [], 1
    while p <= largest:
        if p <= ranks_per_node or p % ranks_per_node == 0:
            out.append(p)
        p *= 2
    return out


# ----------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------
def load_calibration(path):
    """The JSON `--calibrate` wrote; ValueError naming what is wrong."""
    try:
        with open(path) as f:
            cal = json.load(f)
    except UnicodeDecodeError:
        raise ValueError(f"cannot read the calibration {path}: it is not text (a data file "
                         f"or a checkpoint?); give the calibration.json that `simulate "
                         f"--calibrate` wrote") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the calibration {path}: {e}") from None
    if not isinstance(cal, dict) or not {"compute", "links"} <= set(cal):
        raise ValueError(f"{path} is not a calibration written by `simulate --calibrate` "
                         f"(no 'compute' and 'links')")
    return cal


def run(args):
    """The `simulate` command (without --calibrate): a table, or JSON with --json."""
    device = DEVICES[args.device]
    calibration = load_calibration(args.calibration) if args.calibration else None
    k = args.ranks_per_node or device.ranks_per_node
    if args.ranks > k and args.ranks % k:
        given = (f"--ranks-per-node {k}" if args.ranks_per_node else
                 f"{k} ranks (a {args.device} node; --ranks-per-node sets another)")
        raise ValueError(f"--ranks {args.ranks} is not a whole number of nodes of {given}; "
                         f"give a multiple of {k}")
    net = Link.of(args.network_latency, args.network * GBIT)
    algorithms = [*algorithms_of(device), "hybrid"] if args.allreduce == "all" \
        else [args.allreduce]
    if "shm" in algorithms and not device.cores:
        raise ValueError("shm sums in a CPU host's shared memory; a GPU runs 2d "
                         "(choose flat, hierarchical, 2d, hybrid or all)")
    image_size = args.image_size or 224
    batch = args.batch_per_rank or 32
    classes = 1000                      # ImageNet's: the scale this model predicts
    work = gradient_buckets(args.model, args.fusion_threshold, image_size, classes)
    wire = 2 if args.comm_dtype == "fp16" else 4
    rank_counts = sweep_ranks(k) if args.sweep else [args.ranks]
    rows = [predict(work, Cluster(device, p, k, net, calibration, args.across), a, batch, wire,
                    args.overlap)
            for p in rank_counts for a in algorithms]
    result = dict(model=args.model, image_size=image_size, parameters=int(work.params.sum()),
                  num_classes=classes,
                  tensors=work.tensors, buckets=len(work.bounds), threshold=args.fusion_threshold,
                  comm_dtype=args.comm_dtype, overlap=args.overlap, device=args.device,
                  device_name=device.name, device_source=device.source,
                  link_source=device.link_source,
                  calibration=args.calibration, ranks_per_node=k, network_gbps=args.network,
                  across=args.across,
                  batch_per_rank=batch, epochs=args.epochs, rows=rows)
    for r in rows:
        r["epochs_minutes"] = args.epochs * IMAGENET_IMAGES / r["images_per_s"] / 60
    print(json.dumps(result) if args.json else
          (format_sweep(result, algorithms) if args.sweep else format_table(result)))
    return result


def _header(r):
    cal = f", calibration {r['calibration']}" if r["calibration"] else ""
    return [f"simulate: {r['model']} at {r['image_size']}x{r['image_size']}, "
            f"{r['parameters']:,} parameters ({r['num_classes']} classes) in {r['tensors']} "
            f"tensors, {r['buckets']} buckets "
            f"of >= {r['threshold']:,} bytes, {r['comm_dtype']} on the wire, "
            f"{'overlapped with' if r['overlap'] else 'after'} backward",
            f"device {r['device']}: {r['device_name']}{cal}; {r['ranks_per_node']} ranks per "
            f"node, network {r['network_gbps']:g} Gbit/s per node ({r['across']} across nodes); "
            f"batch {r['batch_per_rank']} per rank"]


def format_table(r):
    first = r["rows"][0]
    lines = _header(r) + [
        f"{first['ranks']:,} rank(s); compute per step: forward {first['forward'] * 1e3:.1f} ms, "
        f"backward {first['backward'] * 1e3:.1f} ms, update {first['update'] * 1e3:.1f} ms",
        "",
        f"{'algorithm':<13} {'comm ms':>10} {'exposed ms':>10} {'step ms':>10} "
        f"{'images/s':>12} {'efficiency':>10} "
        f"{format(r['epochs'], 'g') + ' epochs min':>14}  picks"]
    for row in r["rows"]:
        lines.append(f"{row['algorithm']:<13} {row['comm'] * 1e3:>10.2f} "
                     f"{row['exposed'] * 1e3:>10.2f} "
                     f"{row['step'] * 1e3:>10.2f} {row['images_per_s']:>12,.0f} "
                     f"{row['efficiency']:>10.3f} {row['epochs_minutes']:>14.1f}  "
                     f"{','.join(row['chosen'])}")
    return "\n".join(lines)


def format_sweep(r, algorithms):
    lines = _header(r) + ["", "scaling efficiency (step of 1 rank / step of N ranks):",
                          f"{'ranks':>6} " + " ".join(f"{a:>13}" for a in algorithms)]
    for p in sorted({row["ranks"] for row in r["rows"]}):
        eff = {row["algorithm"]: row["efficiency"] for row in r["rows"] if row["ranks"] == p}
        lines.append(f"{p:>6} " + " ".join(f"{eff[a]:>13.3f}" for a in algorithms))
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# Calibration against this host
# ----------------------------------------------------------------------------
FIT_RANGE = 16      # calibrate fits buffers from threshold / FIT_RANGE up


def fit_link(algorithm, p, sizes, seconds):
    """The Link (α, β) whose allreduce_time(algorithm, n, p on one node) fits the measured
    `seconds` for buffers of `sizes` bytes best in relative terms (least squares of
    predicted / measured - 1, so that 4 KiB and 64 MiB weigh alike), α, β >= 0."""
    ab = np.array([coefficients(algorithm, n, p) for n in sizes])
    t = np.asarray(seconds, np.float64)
    a = ab / t[:, None]
    x, *_ = np.linalg.lstsq(a, np.ones(len(t)), rcond=None)
    if (x < 0).any():                   # the best fit with the negative one at zero
        keep = int(np.argmax(x))
        x = np.zeros(2)
        x[keep] = a[:, keep].sum() / (a[:, keep] ** 2).sum()
    return Link(float(x[0]), float(x[1]))


def _bench(argv, ranks, out_dir, name, threads=None, copies=1):
    """Run `python -m mpitrain bench ... --json` (under this host's mpiexec for ranks > 1),
    save its JSON as out_dir/name.json and return it. threads: fix each process's thread
    count (else each rank gets its share of the cores, as in training). copies > 1: that
    many independent processes at once, their results in a list."""
    from mpitrain.launcher import find_mpiexec, job_environment, launch_options, mpiexec_family
    from mpitrain.launcher import THREAD_VARIABLES
    cmd = [sys.executable, "-m", "mpitrain", *argv, "--json"]
    family = None
    if ranks > 1:
        mpiexec = find_mpiexec()
        if mpiexec is None:
            raise RuntimeError("no mpiexec found: run ./launch.sh setup")
        family = mpiexec_family(mpiexec)
        cmd = [mpiexec, *launch_options(ranks, family), "-np", str(ranks), *cmd]
    env = {k: v for k, v in job_environment(family).items() if k not in THREAD_VARIABLES}
    if threads:
        env.update(dict.fromkeys(THREAD_VARIABLES, str(threads)))
    began = time.monotonic()
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(copies)]
    outputs = [p.communicate() for p in procs]
    print(f"  {name} ({time.monotonic() - began:.0f} s): python {' '.join(argv)}"
          f"{f' on {ranks} ranks' if ranks > 1 else ''}"
          f"{f', {copies} processes at once' if copies > 1 else ''}", flush=True)
    for p, (_, err) in zip(procs, outputs):
        if p.returncode:
            raise RuntimeError(f"{name} failed (exit {p.returncode}):\n{err[-3000:]}")
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    result = results if copies > 1 else results[0]
    save_json(os.path.join(out_dir, f"{name}.json"), result)
    return result


def calibrate(args):
    """`simulate --calibrate`: measure, fit, save, and print predicted against measured."""
    model, size, batch = args.model, args.image_size or 64, args.batch_per_rank or 8
    from mpitrain import launcher
    cores = launcher.cores()
    top = args.max_ranks
    problem = (f"--out {args.out} is a file; give a directory for calibration.json and the "
               f"benchmarks' output" if os.path.isfile(args.out) else
               output_problem(os.path.join(args.out, "calibration.json")))
    if problem:         # before minutes of benchmarks
        raise ValueError(problem)
    os.makedirs(args.out, exist_ok=True)
    step_args = ["bench", "step", "--model", model, "--image-size", str(size), "--batch",
                 str(batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
                 "--fusion-threshold", str(args.fusion_threshold), "--allreduce", "hybrid"]
    comm_args = ["bench", "comm", "--model", model, "--fusion-mib", "4", "--repeats",
                 str(args.repeats), "--algorithms", ",".join(ALGORITHMS), "--wires", "fp32"]
    began = time.monotonic()
    print(f"simulate --calibrate: {model} at {size}x{size}, batch {batch} per rank, 1 to {top} "
          f"ranks on this host ({cores} cores); output in {args.out}", flush=True)
    try:
        one = {t: _bench(step_args, 1, args.out, f"step-1rank-{t}thread", threads=t)
               for t in sorted({1, cores})}
        # the compute of p ranks sharing the host: p processes' steps at once, no MPI
        shared = {p: _bench(step_args, 1, args.out, f"step-{p}processes",
                            threads=max(1, cores // p), copies=p) for p in range(2, top + 1)}
        comm, step = {}, {}
        for p in range(2, top + 1):     # each rank count's two runs close together in time
            comm[p] = _bench(comm_args, p, args.out, f"comm-{p}ranks")
            step[p] = _bench(step_args, p, args.out, f"step-{p}ranks")
    except RuntimeError as e:
        sys.exit(f"python -m mpitrain simulate --calibrate: error: {e}")

    work = gradient_buckets(model, args.fusion_threshold, size)
    # compute: forward MACs per second at 1 thread and at all cores; phase shares at 1 thread
    ours = {t: r["mpitrain"] for t, r in one.items()}

    def rate(ms):                       # forward MACs per second of a step of `ms`
        return batch * work.macs / (ms * 1e-3)
    # p ranks in step wait for the slowest: the longest of the p processes' steps
    slowest = {p: max(r["mpitrain"]["step_ms"] for r in runs) for p, runs in shared.items()}
    compute = dict(cores=cores, model=model, image_size=size, batch=batch,
                   macs_per_s={str(t): rate(o["step_ms"]) for t, o in ours.items()},
                   shared_macs_per_s={"1": rate(ours[cores]["step_ms"]),
                                      **{str(p): rate(ms) for p, ms in slowest.items()}},
                   shares=[ours[1][f"{k}_ms"] / ours[1]["step_ms"]
                           for k in ("forward_loss", "backward", "update")])
    links = {a: {} for a in ALGORITHMS}
    for p, r in comm.items():
        # the sizes buckets have: caches make smaller buffers cheaper per byte than the
        # buckets, which live in memory
        rows = [s for s in r["sweep"] if s["bytes"] >= args.fusion_threshold // FIT_RANGE]
        for a in ALGORITHMS:        # medians, as bench step's times are
            fit = fit_link(a, p, [s["bytes"] for s in rows],
                           [s["median"][a] * 1e-3 for s in rows])
            links[a][str(p)] = dict(alpha=fit.alpha, beta=fit.beta)
    cal = dict(host=dict(cores=cores), compute=compute, links=links,
               command=" ".join(["python -m mpitrain", *sys.argv[1:]]))
    path = os.path.join(args.out, "calibration.json")
    save_json(path, cal)

    table = compare(work, cal, one, comm, step, batch)
    save_text(os.path.join(args.out, "comparison.txt"), table + "\n")
    print(table)
    print(f"fit saved to {path} (use: python -m mpitrain simulate --device cpu --calibration "
          f"{path}); {time.monotonic() - began:.0f} s")


def compare(work, cal, one, comm, step, batch):
    """The predicted-against-measured tables of a calibration (text)."""
    device = DEVICES["cpu"]
    cores = cal["host"]["cores"]
    net = Link(0.0, 0.0)                # one host: no network
    lines = ["", "the fit, per algorithm and rank count (one node): alpha us, bandwidth GB/s "
                 "(1 / beta)"]
    for a, fits in cal["links"].items():
        lines.append(f"  {a:<13} " + "  ".join(
            f"{p} ranks: {f['alpha'] * 1e6:6.1f} us {_gbps(f['beta']):7.2f} GB/s"
            for p, f in fits.items()))

    lines += ["", "all-reduce of the arena in 4 MiB slices (bench comm, fp32, median ms):",
              f"{'ranks':>5} " + " ".join(f"{a + ' pred/meas':>24}" for a in ALGORITHMS)]
    for p, r in comm.items():
        n = r["values"]
        slices = [min(1 << 20, n - s) * 4 for s in range(0, n, 1 << 20)]
        cluster = Cluster(device, p, p, net, cal)
        cells = []
        for a in ALGORITHMS:
            pred = sum(allreduce_time(a, s, p, p, cluster.node_link(a), net) for s in slices)
            meas = next(x["ms"] for x in r["rows"] if x["algorithm"] == a
                        and x["mode"] == "fused 4 MiB" and x["wire"] == "fp32")
            cells.append(f"{pred * 1e3:8.1f} / {meas:7.1f} {_off(pred * 1e3, meas):>6}")
        lines.append(f"{p:>5} " + " ".join(f"{c:>24}" for c in cells))

    lines += ["", f"training step (bench step, {len(work.bounds)} buckets, hybrid, after backward; "
                  f"median ms; the all-reduce on the rank that reached it last):",
              f"{'ranks':>5} {'step pred':>10} {'step meas':>10} {'off':>6} "
              f"{'all-reduce pred':>16} {'meas':>8} {'off':>6}  hybrid picks"]
    for p in [1, *step]:
        if p == 1:      # bench step's own 1-rank steps (with all the cores' threads)
            meas_step = float(np.median([s["one_rank"]["step_ms"] for s in step.values()
                                         if s["one_rank"]["threads"] == cores]))
            meas_comm = 0.0
        else:
            meas_step = step[p]["no_overlap"]["step_ms"]
            meas_comm = step[p]["no_overlap"]["allreduce_ms"]
        pred = predict(work, Cluster(device, p, p, net, cal), "hybrid", batch, overlap=False)
        lines.append(f"{p:>5} {pred['step'] * 1e3:>10.1f} {meas_step:>10.1f} "
                     f"{_off(pred['step'] * 1e3, meas_step):>6} {pred['comm'] * 1e3:>16.1f} "
                     f"{meas_comm:>8.1f} "
                     f"{_off(pred['comm'] * 1e3, meas_comm) if p > 1 else '':>6}  "
                     f"{','.join(pred['chosen']) if p > 1 else ''}")
    return "\n".join(lines)


def _gbps(beta):
    return 1e-9 / beta if beta > 0 else float("inf")


def _off(pred, meas):
    return f"{(pred - meas) / meas:+.0%}" if meas else "n/a"
