"""The α-β cost model of `python -m mpitrain simulate`: each collective's formula and the
overlap against hand-computed values, the bucket schedule against the code's own, the
sweep's shape, the fit, the command line, and one real calibration."""
import json
import subprocess
import sys

import numpy as np
import pytest

from mpitrain.cli import main
from mpitrain.comm.buckets import bucket_bounds
from mpitrain.nets import build_model
from mpitrain.tools.simulate import (DEVICES, RESNET50_MACS, Cluster, Link, allreduce_time,
                               exposed_comm, fit_link, gradient_buckets, predict, ring,
                               sweep_ranks)

INTRA = Link(1e-6, 1e-10)       # 1 us, 10 GB/s
NET = Link(5e-6, 1e-9)          # 5 us, 1 GB/s
N = 1e6                         # bytes


def test_ring_allreduce_formula():
    # 2 (p-1) alpha + 2 (p-1)/p n beta
    assert ring(4, N, INTRA) == pytest.approx(6e-6 + 1.5 * N * 1e-10)
    assert ring(1, N, INTRA) == 0.0


@pytest.mark.parametrize("algorithm,expected", [
    # 16 ranks = 4 nodes of 4: the flat ring's every step waits for the network
    ("flat", 30 * 5e-6 + 30 / 16 * N * 1e-9),
    # chain reduce + broadcast in the node (3 alpha + n beta each), ring of the 4 leaders
    ("hierarchical", 2 * (3e-6 + N * 1e-10) + 6 * 5e-6 + 1.5 * N * 1e-9),
    # reduce-scatter + all-gather in the node (3 alpha + 3/4 n beta each), shard rings
    ("2d", 2 * (3e-6 + 0.75 * N * 1e-10) + 6 * 5e-6 + 1.5 * N * 1e-9),
    # two barriers, 2 K n bytes of node memory traffic, shard rings
    ("shm", 2e-6 + 2 * 4 * N * 1e-10 + 6 * 5e-6 + 1.5 * N * 1e-9),
])
def test_each_algorithm_on_four_nodes_of_four(algorithm, expected):
    assert allreduce_time(algorithm, N, 16, 4, INTRA, NET) == pytest.approx(expected)


def test_halving_doubling_across_nodes():
    # 2 log2(m) alpha + 2 (m-1)/m n beta among the 4 leaders; flat over 16 ranks pays
    # 2 log2(16) steps, with the 4 ranks of a node sharing its network link
    tree = 4 * 5e-6 + 1.5 * N * 1e-9
    assert allreduce_time("hierarchical", N, 16, 4, INTRA, NET, "tree") == pytest.approx(
        2 * (3e-6 + N * 1e-10) + tree)
    assert allreduce_time("flat", N, 16, 4, INTRA, NET, "tree") == pytest.approx(
        8 * 5e-6 + 30 / 16 * N * 4e-9)


def test_one_node_never_touches_the_network():
    assert allreduce_time("flat", N, 4, 8, INTRA, NET) == pytest.approx(ring(4, N, INTRA))
    assert allreduce_time("hierarchical", N, 4, 8, INTRA, NET) == pytest.approx(
        2 * (3e-6 + N * 1e-10))
    for a in ("flat", "hierarchical", "2d", "shm"):
        assert allreduce_time(a, N, 1, 8, INTRA, NET) == 0.0


def test_hierarchy_cuts_the_latency_the_flat_ring_pays():
    # 1,024 ranks, a 4 KiB tensor: flat pays 2 x 1023 network steps, hierarchical 2 x 127
    small = 4096
    flat = allreduce_time("flat", small, 1024, 8, INTRA, NET)
    hier = allreduce_time("hierarchical", small, 1024, 8, INTRA, NET)
    assert flat == pytest.approx(2046 * 5e-6 + 2 * 1023 / 1024 * small * 1e-9)
    assert flat / hier > 7


@pytest.mark.parametrize("ready,times,expected", [
    ([0.25, 0.5], [0.5, 0.5], 0.0),   # both done while backward runs (ends at 2.25, 3.0 < 4)
    ([0.5, 1.0], [0.5, 0.5], 0.5),    # the last bucket is ready at 4.0, ends at 4.5
    ([0.1, 0.2], [2.0, 2.0], 1.3),    # queued: 1.3-3.3, then 3.3-5.3
])
def test_overlap_exposes_what_runs_past_backward(ready, times, expected):
    # forward 1 s, backward 3 s: bucket b is ready at 1 + 3 * ready[b]
    assert exposed_comm(1.0, 3.0, ready, times, overlap=True) == pytest.approx(expected)
    assert exposed_comm(1.0, 3.0, ready, times, overlap=False) == pytest.approx(sum(times))


def test_buckets_are_the_codes_own_schedule(work):
    model = build_model("resnet_small", num_classes=10)
    assert work.bounds == bucket_bounds(model.arena, 64 << 10)
    assert len(work.bounds) > 3
    assert work.params.sum() == model.num_params()
    assert (work.elements >= work.params).all()          # padding inside a bucket travels too
    # backward reaches the buckets in arena order; the last holds the first layer
    assert (np.diff(work.ready) >= 0).all() and work.ready[-1] == pytest.approx(1.0)
    assert work.ready[0] < 0.5


def test_resnet50_gradients_and_work_come_from_the_code():
    work = gradient_buckets("resnet50", 4 << 20)
    assert work.params.sum() == 25_557_032 and work.tensors == 161
    assert work.macs == RESNET50_MACS
    assert work.bounds == bucket_bounds(build_model("resnet50").arena, 4 << 20)


@pytest.fixture(scope="module")
def work():
    return gradient_buckets("resnet_small", 64 << 10, image_size=32, num_classes=10)


def test_sweep_efficiency_is_at_most_one_and_falls_for_the_flat_ring(work):
    ranks = sweep_ranks(8)
    assert ranks == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    net = Link.of(5, 100e9 / 8)
    for algorithm in ("flat", "hierarchical", "2d", "hybrid"):
        eff = [predict(work, Cluster(DEVICES["v100"], p, 8, net), algorithm, 32)["efficiency"]
               for p in ranks]
        assert eff[0] == pytest.approx(1.0)
        assert all(e <= 1.0 + 1e-12 for e in eff)
        if algorithm == "flat":
            assert all(b <= a + 1e-12 for a, b in zip(eff, eff[1:]))
            assert eff[-1] < 0.9


def test_hybrid_is_never_slower_than_any_algorithm(work):
    net = Link.of(5, 25e9 / 8)
    for p in (2, 8, 64, 1024):
        cluster = Cluster(DEVICES["p40"], p, 8, net)
        comm = {a: predict(work, cluster, a, 32, overlap=False)["comm"]
                for a in ("flat", "hierarchical", "2d", "hybrid")}
        assert comm["hybrid"] <= min(comm.values()) + 1e-12


def test_a_calibrated_host_gives_each_rank_count_its_measured_rate(work):
    """p ranks on a 2-core host: the rate measured with p processes at once where the
    calibration has it, else the 1-thread rate times 2/p; split by the measured shares."""
    cal = {"compute": {"cores": 2, "macs_per_s": {"1": 1e9, "2": 1.8e9},
                       "shared_macs_per_s": {"1": 1.8e9, "2": 0.8e9, "3": 0.5e9},
                       "shares": [0.3, 0.6, 0.1]}, "links": {}}
    macs = 8 * work.macs
    for p, rate in ((1, 1.8e9), (2, 0.8e9), (3, 0.5e9), (4, 1e9 * 2 / 4)):
        c = Cluster(DEVICES["cpu"], p, p, Link(0.0, 0.0), cal).compute(work, 8)
        assert (c.forward, c.backward, c.update) == pytest.approx(
            (0.3 * macs / rate, 0.6 * macs / rate, 0.1 * macs / rate))


def test_fit_recovers_alpha_and_beta():
    true = Link(7e-6, 1 / 3e9)
    sizes = [4096 * 4 ** k for k in range(8)]
    for algorithm in ("flat", "hierarchical", "2d", "shm"):
        seconds = [allreduce_time(algorithm, n, 3, 3, true, NET) for n in sizes]
        fit = fit_link(algorithm, 3, sizes, seconds)
        assert fit.alpha == pytest.approx(true.alpha, rel=1e-6)
        assert fit.beta == pytest.approx(true.beta, rel=1e-6)


def test_simulate_prints_every_algorithm(capsys):
    main(["simulate", "--model", "resnet_small", "--image-size", "32", "--ranks", "64",
          "--device", "v100", "--network", "100"])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("algorithm"))
    assert header.split()[:6] == ["algorithm", "comm", "ms", "exposed", "ms", "step"]
    assert "efficiency" in header
    rows = [line.split()[0] for line in out.splitlines()[out.splitlines().index(header) + 1:]]
    assert rows == ["flat", "hierarchical", "2d", "hybrid"]


def test_simulate_sweep_json(capsys):
    main(["simulate", "--model", "resnet_small", "--image-size", "32", "--device", "h100",
          "--allreduce", "hierarchical", "--comm-dtype", "fp16", "--sweep", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert [row["ranks"] for row in r["rows"]] == sweep_ranks(8)
    assert all(0 < row["efficiency"] <= 1.0 + 1e-12 for row in r["rows"])


@pytest.mark.parametrize("argv,message", [
    (["--ranks", "12", "--ranks-per-node", "8"], "--ranks 12 is not a whole number of nodes "
                                                 "of --ranks-per-node 8; give a multiple of 8"),
    (["--ranks", "12", "--device", "v100"], "--ranks 12 is not a whole number of nodes of 8 "
                                            "ranks (a v100 node; --ranks-per-node sets "
                                            "another); give a multiple of 8"),
    (["--device", "v100", "--allreduce", "shm"], "shm sums in a CPU host's shared memory"),
    (["--device", "p40", "--calibration", "x.json"], "use it with --device cpu"),
    (["--network", "0"], "argument --network: 0 must be > 0.0"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--calibrate", "--sweep"], "run --sweep or --calibration FILE in a separate command"),
    (["--sweep", "--ranks", "8"], "--sweep predicts every rank count from 1 to 4,096; drop "
                                  "--ranks 8, or drop --sweep for 8 alone"),
    (["--device", "cpu", "--calibration", "no/such.json"], "cannot read the calibration"),
])
def test_bad_simulate_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--model", "resnet_small", "--image-size", "32", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_file_where_calibrate_writes_a_directory_is_refused_before_measuring(tmp_path,
                                                                                capsys):
    """It ended in "File exists" (status 1) after the benchmarks' set-up."""
    data = tmp_path / "digits_val.h5"
    data.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(100))
    for out, message in ((data, f"--out {data} is a file; give a directory for "
                                f"calibration.json and the benchmarks' output"),
                         (data / "cal", f"{data} is a file, so {data / 'cal'}/calibration.json "
                                        f"cannot be written")):
        with pytest.raises(SystemExit) as exit_:
            main(["simulate", "--calibrate", "--out", str(out)])
        out_, err = capsys.readouterr()
        assert exit_.value.code == 2 and message in err and out_ == "", err
    assert data.read_bytes()[:4] == b"\x89HDF" and len(list(tmp_path.iterdir())) == 1


def test_a_calibration_that_is_not_text_is_named(tmp_path, capsys):
    """An HDF5 file given as --calibration was answered with Python's decoding error alone
    ("'utf-8' codec can't decode byte 0x89"), not the file."""
    data = tmp_path / "digits_val.h5"
    data.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(100))
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--device", "cpu", "--calibration", str(data)])
    assert exit_.value.code == 2
    assert f"error: cannot read the calibration {data}: it is not text (a data file or a " \
           f"checkpoint?); give the calibration.json that `simulate --calibrate` wrote\n" \
        in capsys.readouterr().err


@pytest.mark.launches
@pytest.mark.one_mpi
def test_calibrate_measures_fits_and_feeds_the_model(tmp_path):
    import launcher
    out = tmp_path / "cal"
    r = subprocess.run([sys.executable, "-m", "mpitrain", "simulate", "--calibrate",
                        "--model", "resnet_small", "--image-size", "32", "--max-ranks", "2",
                        "--steps", "1", "--warmup", "1", "--repeats", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env=launcher.environment())
    assert r.returncode == 0, r.stderr
    cal = json.loads((out / "calibration.json").read_text())
    # each algorithm's fit predicts the sums it was fitted to (bench comm's medians at the
    # buckets' sizes) within a factor of 2, in the median
    from mpitrain.tools.simulate import FIT_RANGE, coefficients
    comm = json.loads((out / "comm-2ranks.json").read_text())
    sweep = comm["sweep"]
    sizes = [s["bytes"] for s in sweep]         # each once, up to the fp32 arena's whole
    assert {s["wire"] for s in sweep} == {"fp32"}
    assert sizes == sorted(set(sizes)) and sizes[-1] == comm["values"] * 4, sizes
    rows = [s for s in sweep if s["bytes"] >= (4 << 20) // FIT_RANGE]
    for algorithm in ("flat", "hierarchical", "2d", "shm"):
        fit = cal["links"][algorithm]["2"]
        errors = [abs((fit["alpha"] * ca + fit["beta"] * cb) / (s["median"][algorithm] * 1e-3)
                      - 1) for s in rows for ca, cb in [coefficients(algorithm, s["bytes"], 2)]]
        assert np.median(errors) < 1.0, (algorithm, fit, errors)
    assert cal["compute"]["macs_per_s"]["1"] > 0
    # measured sharing: 1 process with all the cores, 2 processes at once
    assert set(cal["compute"]["shared_macs_per_s"]) == {"1", "2"}
    assert min(cal["compute"]["shared_macs_per_s"].values()) > 0
    lines = r.stdout.splitlines()
    table = lines.index(next(line for line in lines if line.startswith("training step")))
    assert [line.split()[0] for line in lines[table + 2:table + 4]] == ["1", "2"]
    used = subprocess.run([sys.executable, "-m", "mpitrain", "simulate", "--model", "resnet_small",
                           "--image-size", "32", "--device", "cpu", "--ranks", "2",
                           "--calibration", str(out / "calibration.json"), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert used.returncode == 0, used.stderr
    rows = json.loads(used.stdout)["rows"]
    assert {row["algorithm"] for row in rows} == {"flat", "hierarchical", "2d", "shm", "hybrid"}
