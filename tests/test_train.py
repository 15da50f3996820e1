"""The training pieces: the batch check, and the default job end to end under mpirun
(the optimizers and schedules are tested in test_optim.py)."""
import re
import subprocess
import sys

import pytest

from mpitrain.checks import ConfigError, check_batch
import launcher


def test_check_batch():
    check_batch(64, 4, num_train=1000)
    with pytest.raises(ConfigError, match="does not divide by the 3 MPI ranks"):
        check_batch(64, 3)
    with pytest.raises(ConfigError, match="exceeds the 100 training images"):
        check_batch(128, 2, num_train=100)


def test_shard_update_refuses_the_all_reduce_options():
    from mpitrain.checks import comm_options
    from mpitrain.options import Config
    comm_options(Config(shard_update=True), 2)
    for key, value in (("comm_dtype", "fp16"), ("allreduce", "2d"), ("overlap", True)):
        with pytest.raises(ConfigError, match=f"--shard-update .* --{key.replace('_', '-')} "
                                              f"{value} does not apply"):
            comm_options(Config(shard_update=True, **{key: value}), 2)


def test_bn_groups_are_refused_for_a_network_without_batchnorm():
    from mpitrain.checks import comm_options
    from mpitrain.options import Config
    comm_options(Config(model="alexnet_bn", bn_group=2), 2)
    with pytest.raises(ConfigError, match="--bn-group 2 takes BatchNorm's statistics over "
                                          "groups of ranks, and alexnet has no BatchNorm "
                                          "layer: drop --bn-group"):
        comm_options(Config(model="alexnet", bn_group=2), 2)


# ----- the command, under mpirun -----
def run_train(ranks, *args, timeout):
    """`mpirun -np ranks python -m mpitrain train args`, with each rank's share of the cores
    (as launch.sh gives it)."""
    return subprocess.run(launcher.mpitrain_command(ranks, "train", *args), capture_output=True,
                          text=True, timeout=timeout, env=launcher.environment(ranks))


@pytest.mark.launches
def test_batch_that_does_not_divide_is_refused_before_any_work():
    r = run_train(2, "--batch-size", "63", timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--batch-size 63, the global batch, does not divide by the 2 MPI ranks" in r.stderr
    assert r.stderr.count("does not divide") == 1          # said once, by rank 0
    assert "usage:" not in r.stderr                         # the reason alone
    assert "epoch" not in r.stdout                          # no training happened


@pytest.mark.launches
def test_default_job_reaches_95_percent(tmp_path):
    r = run_train(2, "--data-dir", str(tmp_path), "--run-dir", str(tmp_path / "run"), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    final = re.findall(r"final validation accuracy: ([\d.]+)% top-1", r.stdout)
    assert len(final) == 1, r.stdout                        # rank 0 alone reports
    assert float(final[0]) >= 95.0, r.stdout
    assert (tmp_path / "digits_train.h5").exists()          # it trained from converted files
    # what the start and the epochs say: the buckets' real size, the options that differ
    # from the defaults, and the time since the start, named
    from mpitrain.comm.buckets import bucket_bounds
    from mpitrain.nets import build_model
    (start, stop), = bucket_bounds(build_model("resnet_small", num_classes=10).arena)
    assert f"gradients: 1 bucket(s) of {(stop - start) * 4:,} bytes (each closed at " \
        f"4,194,304 bytes)" in r.stdout, r.stdout
    config = r.stdout.split("configuration: ")[1].split("\nenvironment")[0]
    assert "options at their defaults, these not" in config and "run_dir=" in config
    assert " model=" not in config and "allreduce=" not in config
    assert re.search(r"epoch 8/8 .* s since the start\)", r.stdout), r.stdout
    assert "\\x00" not in r.stdout
    # the MPI library's name, a value with spaces, quoted whole on one line
    assert re.search(r"\bmpi_library='(MPICH|Open MPI)[^'\n]*'", r.stdout), r.stdout


def test_a_start_line_wraps_between_values_never_inside_one():
    from mpitrain.config import describe
    data = {"a": "x " * 30, "b": "MPICH Version:      5.0.2", "c": 3, "d": "y" * 120}
    text = describe("environment", data, width=40)
    assert text.split("\n") == [f"environment: a={' '.join(['x'] * 30)!r}",
                                 "  b='MPICH Version: 5.0.2' c=3", f"  d={'y' * 120}"]
    assert describe("title", {"k": 1, "m": "two words"}) == "title: k=1 m='two words'"
    assert describe("title", {"hosts": ["nodeA", "nodeB"], "crop_scale": (0.08, 1.0)}) \
        == "title: crop_scale=0.08,1.0 hosts=nodeA,nodeB"


@pytest.mark.launches
@pytest.mark.one_mpi
def test_fusion_threshold_auto_chooses_saves_and_resumes_with_the_choice(tmp_path):
    import json

    from mpitrain import checkpoint
    job = ("--epochs", "2", "--batch-size", "64", "--data-dir", str(tmp_path),
           "--fusion-threshold", "auto")
    r = run_train(2, *job, "--run-dir", str(tmp_path / "run"), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    chosen = re.findall(r"fusion threshold auto: chose (\d+ [KM]iB); median step per "
                        r"threshold: (.*); (\d+) bucket\(s\) from step (\d+)", r.stdout)
    assert len(chosen) == 1, r.stdout                       # once, by rank 0
    tried = re.findall(r"(\d+ [KM]iB) \((\d+) bucket\(s\)\) [\d.]+ ms", chosen[0][1])
    assert len(tried) >= 2 and chosen[0][0] in [t for t, _ in tried], r.stdout
    assert len({b for _, b in tried}) == len(tried)          # distinct layouts only
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    fusion = [rec for rec in records if rec["kind"] == "fusion"]
    assert len(fusion) == 1 and fusion[0]["chosen"] in fusion[0]["candidates"]
    assert fusion[0]["global_step"] == int(chosen[0][3]) - 1
    mid = checkpoint.read(str(tmp_path / "run" / "checkpoint-000000022.h5"))
    assert mid["progress"]["fusion"] == {k: fusion[0][k] for k in ("candidates", "times", "chosen")}
    # resumed, the run keeps the choice instead of measuring again
    r = run_train(2, *job, "--run-dir", str(tmp_path / "resumed"), "--resume",
                  str(tmp_path / "run" / "checkpoint-000000022.h5"), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bytes, chosen by --fusion-threshold auto)" in r.stdout, r.stdout
    assert "fusion threshold auto: chose" not in r.stdout
    size = fusion[0]["chosen"]
    assert f"(each closed at {size:,} bytes, chosen by" in r.stdout


@pytest.mark.launches
@pytest.mark.one_mpi
def test_topk_job_at_density_001_reaches_97_percent(tmp_path):
    """1% of each gradient bucket sent per step, the rest fed back: within about a point of
    the dense job (about 98.6%, docs/benchmarks.md)."""
    r = run_train(2, "--compress", "topk", "--density", "0.01", "--data-dir", str(tmp_path),
                  "--run-dir", str(tmp_path / "run"), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "top-k: each bucket's 0.01 largest fraction sent" in r.stdout
    final = re.findall(r"final validation accuracy: ([\d.]+)% top-1", r.stdout)
    assert len(final) == 1, r.stdout
    assert float(final[0]) >= 97.0, r.stdout


def final_top1(r):
    assert r.returncode == 0, r.stdout + r.stderr
    return float(re.findall(r"final validation accuracy: ([\d.]+)% top-1", r.stdout)[0])


@pytest.mark.launches
@pytest.mark.one_mpi
def test_shard_update_reaches_the_unsharded_accuracy(tmp_path):
    """Two epochs of the default job, sharded and not, from the same seed: the same numbers
    up to float32 rounding, hence the same accuracy."""
    args = ("--data-dir", str(tmp_path), "--epochs", "2", "--checkpoint-every", "0")
    plain = final_top1(run_train(2, *args, "--run-dir", str(tmp_path / "a"), timeout=600))
    r = run_train(2, *args, "--run-dir", str(tmp_path / "b"), "--shard-update", timeout=600)
    assert "reduce-scatter into 2 shard(s)" in r.stdout
    assert abs(final_top1(r) - plain) <= 1.0, r.stdout


def test_set_threads_sets_openmp_numba_and_blas():
    """The thread count a rank runs on reaches every pool of its kernels: OpenMP through
    threadpoolctl, Numba's parallel kernels through its own setting; BLAS runs one
    thread where the GEMMs are cut among that team (kernels.gemm.team_gemms), else as
    many."""
    import numba
    from threadpoolctl import threadpool_info, threadpool_limits

    from mpitrain.kernels import gemm
    from mpitrain.launcher import set_threads
    before = numba.get_num_threads()
    with threadpool_limits(None):           # restores the pools' counts afterwards
        try:
            for n in (1, 2):
                set_threads(n)
                assert numba.get_num_threads() == min(n, numba.config.NUMBA_NUM_THREADS)
                pools = {(i["user_api"], i["num_threads"]) for i in threadpool_info()}
                blas = 1 if gemm.team_gemms(n) else n
                assert ("blas", blas) in pools, pools
                assert all(k == (blas if api == "blas" else n) for api, k in pools), pools
        finally:
            numba.set_num_threads(before)


@pytest.mark.launches
@pytest.mark.one_mpi
@pytest.mark.parametrize("optimizer,options", [
    ("neumann", ("--lr", "0.1")),
    ("nlcg", ("--lr", "0.01", "--precision", "fp16", "--shard-update")),
])
def test_neumann_and_nlcg_train_the_digits(tmp_path, optimizer, options):
    """Three epochs of the digits job with each of the other large-batch optimizers (NLCG
    under fp16 and weight-update sharding): about 96% (Neumann) and 98% (NLCG)."""
    r = run_train(2, "--optimizer", optimizer, *options, "--epochs", "3", "--data-dir",
                  str(tmp_path), "--run-dir", str(tmp_path / "run"), "--checkpoint-every", "0",
                  timeout=600)
    assert f"optimizer {optimizer}, peak lr" in r.stdout, r.stdout + r.stderr
    assert final_top1(r) >= 90.0, r.stdout


def test_a_warm_up_longer_than_the_run_is_said_at_the_start(digits, tmp_path):
    r = subprocess.run([sys.executable, "-m", "mpitrain", "train", "--epochs", "1",
                        "--warmup-epochs", "2", "--batch-size", "64", "--data-dir", str(digits),
                        "--run-dir", str(tmp_path / "run"), "--checkpoint-every", "0"],
                       capture_output=True, text=True, timeout=300, env=launcher.environment(1))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(cosine after 2 warm-up epochs: longer than the run's 1 epoch, so the learning " \
           "rate never reaches its peak)" in r.stdout, r.stdout
    # one epoch is said as one, at the start and at the end
    assert re.search(r"\d+ steps/epoch, 1 epoch\n", r.stdout), r.stdout
    assert re.search(r"top-5 \(\d+ images, 1 epoch, [\d.]+ s\)", r.stdout), r.stdout


def test_a_number_of_epochs_is_said_in_the_singular_for_one():
    from mpitrain.train import epochs
    assert [epochs(1), epochs(8), epochs(1.0, "warm-up "), epochs(0.375, "warm-up ")] == \
        ["1 epoch", "8 epochs", "1 warm-up epoch", "0.375 warm-up epochs"]


def test_bucket_sizes_are_described_from_their_ranges():
    from mpitrain.train import describe_buckets
    assert describe_buckets([(0, 1000)], 4) == "1 bucket(s) of 4,000 bytes"
    assert describe_buckets([(0, 1000), (1024, 1536)], 2) == "2 bucket(s) of 1,024 to 2,000 bytes"
