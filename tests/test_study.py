"""`python -m mpitrain study large-batch`: its grid and learning rates, the train command
line of a run, the table's statistics, refused inputs, and the --quick study end to end
(every recipe at every batch, a run re-made bit for bit from commands.sh)."""
import csv
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest

from mpitrain.tools import study
from mpitrain.cli import build_parser
import launcher


def test_batch_sizes_are_powers_of_two_leaving_two_steps_an_epoch():
    assert study.batch_sizes(1438) == [32, 64, 128, 256, 512]      # 1438 // 512 = 2 steps
    assert study.batch_sizes(1023) == [32, 64, 128, 256]           # 1023 // 512 = 1 step
    assert study.batch_sizes(1438, quick=True) == [32, 128, 512]
    assert study.batch_sizes(64) == [32]
    assert study.batch_sizes(63) == []


def test_peak_learning_rates_follow_each_recipes_rule():
    assert study.peak_lr("sgd", 32) == pytest.approx(0.1)
    assert study.peak_lr("sgd", 512) == pytest.approx(1.6)              # linear: x 16
    assert study.peak_lr("lars", 512) == pytest.approx(4.0)             # sqrt: x 4
    assert study.peak_lr("lars-fp16", 128) == pytest.approx(2.0)
    assert study.peak_lr("lamb", 512) == pytest.approx(0.04)


def test_a_runs_options_survive_trains_command_line():
    """The flags of each recipe's run parse back (through train's own parser) into the
    options the study meant, and the trainer's lr after its scaling rule is the table's."""
    from mpitrain.optim import scaled_lr
    for config in study.CONFIGS:
        options = study.train_options(config, 256, 2, 16, "digits", "runs/x")
        options["augment"] = False
        args = vars(build_parser().parse_args(["train", *study.flags(options)]))
        for key, value in options.items():
            assert args[key] == value, (config, key)
        assert args["warmup_epochs"] == 2.0
        assert scaled_lr(args["lr"], 256, args["lr_ref_batch"]) == \
            pytest.approx(study.peak_lr(config, 256), rel=1e-5)   # 6 digits on the command line


def test_summary_mean_and_sample_sd_over_seeds_leave_diverged_runs_out():
    grid = {("sgd", 64): ["a", "b", "c"], ("lamb", 32): ["d", "e"]}
    results = {"a": dict(top1=0.5, steps=10, skipped_steps=0),
               "b": dict(top1=0.7, steps=10, skipped_steps=0),
               "c": dict(diverged=True),
               "d": dict(top1=0.9, steps=20, skipped_steps=1),
               "e": dict(top1=0.8, steps=20, skipped_steps=3)}
    lamb, sgd = study.summarise(grid, results)                 # sorted by batch
    assert (sgd["batch"], sgd["runs"], sgd["diverged"]) == (64, 3, 1)
    assert sgd["top1_mean"] == pytest.approx(0.6)
    assert sgd["top1_sd"] == pytest.approx(math.sqrt(0.02))     # (0.1^2 + 0.1^2) / (2 - 1)
    assert lamb["skipped_steps"] == [1, 3] and lamb["steps"] == 20
    table = study.table_markdown([lamb, sgd])
    assert "| 64 | sgd | sgd | fp32 | 0.2 | 10 | 60.0% ± 14.1% | 3 (1 diverged) | — |" in table
    # the plot says so beside the point, whose mean is over the seeds left
    from mpitrain.tools.plot import diverged_notes
    assert diverged_notes([lamb, sgd], "sgd") == [(64, pytest.approx(60.0), "sgd: 1/3 diverged")]
    assert diverged_notes([lamb, sgd], "lamb") == []


def test_fashion_mnist_plan_sweeps_learning_rates_at_batches_128_to_4096():
    """Batches 128, 1,024 and 4,096 (7.6% of 54,000 images); three multiples of each rule;
    seeds at the smallest and largest batch; --quick: two batches, two recipes, one epoch."""
    plan = study.plan_for("fashion-mnist")
    assert study.plan_batches(plan, 54000) == [128, 1024, 4096]
    assert plan["lr_factors"] == (0.5, 1.0, 2.0) and plan["decide"] == "ends"
    assert plan["widen"] == 6 and study.plan_for("fashion-mnist", quick=True)["widen"] == 0
    assert plan["recipes"] == ("sgd", "nesterov", "lars", "lars-fp16", "lamb", "neumann", "nlcg")
    assert (plan["epochs"], plan["seeds"]) == (3, 3)
    quick = study.plan_for("fashion-mnist", quick=True)
    assert study.plan_batches(quick, 54000, quick=True) == [128, 4096]
    assert (quick["epochs"], quick["recipes"]) == (1, ("sgd", "lars"))
    assert study.plan_for("data/mine.h5") == study.plan_for("digits")
    assert study.plan_batches(study.plan_for("digits"), 1438) == [32, 64, 128, 256, 512]
    assert study.run_name("lars", 4096, 2, 0.5) == "lars-b4096-lr0.5x-s2"
    assert study.run_name("lars", 4096, 2) == "lars-b4096-s2"


def test_a_sweeps_factor_scales_the_rule_and_the_best_run_chooses_it():
    from mpitrain.optim import scaled_lr
    for config, factor in (("sgd", 0.5), ("nesterov", 2.0), ("lamb", 2.0)):
        options = study.train_options(config, 2048, 0, 4, "fashion-mnist", "runs/x", factor)
        args = vars(build_parser().parse_args(["train", *study.flags(options)]))
        assert scaled_lr(args["lr"], 2048, args["lr_ref_batch"]) == \
            pytest.approx(study.peak_lr(config, 2048, factor), rel=1e-5)
        assert study.peak_lr(config, 2048, factor) == \
            pytest.approx(factor * study.peak_lr(config, 2048))
        assert args["nesterov"] == (config == "nesterov")
    results = {"a": dict(top1=0.80), "b": dict(top1=0.85), "c": dict(diverged=True),
               "d": dict(top1=0.85)}
    assert study.best_factor({0.5: "a", 1.0: "b", 2.0: "c"}, results) == 1.0
    assert study.best_factor({0.5: "d", 1.0: "b"}, results) == 0.5     # a tie: the smaller
    assert study.best_factor({2.0: "c"}, results) is None


def widen_until_bracketed(top1, lr_factors=(0.5, 1.0, 2.0), widen=6):
    """The factors a point's sweep tries, in order, when the run at factor f reaches
    top1[f] (None: diverged)."""
    sweep = {f: f"r{f:g}" for f in lr_factors}
    results = {f"r{f:g}": dict(top1=a) if a is not None else dict(diverged=True)
               for f, a in top1.items()}
    tried = list(lr_factors)
    while (factor := study.past_the_edge(sweep, results, lr_factors, widen)) is not None:
        sweep[factor] = f"r{factor:g}"
        tried.append(factor)
    return tried, study.best_factor(sweep, results)


def test_a_sweep_goes_past_its_edge_until_a_worse_rate_lies_beyond_the_best():
    # SGD at batch 4,096 on Fashion-MNIST, seed 0 (docs/large-batch.md): better three
    # times below the first sweep, then worse: the best is 1/16 of the rule
    sgd = {2.0: 0.10, 1.0: 0.12, 0.5: 0.168, 0.25: 0.204, 0.125: 0.338, 0.0625: 0.627,
           0.03125: 0.606, 0.015625: 0.518}
    assert widen_until_bracketed(sgd) == ([0.5, 1.0, 2.0, 0.25, 0.125, 0.0625, 0.03125], 0.0625)
    # a local best: Nesterov there is worse at 1/4 and 1/8 of the rule, better below
    nesterov = {2.0: 0.10, 1.0: 0.20, 0.5: 0.310, 0.25: 0.142, 0.125: 0.129, 0.0625: 0.493}
    assert widen_until_bracketed(nesterov) == ([0.5, 1.0, 2.0, 0.25], 0.5)
    # best in the middle: nothing more; best at the top: up until a run diverges
    assert widen_until_bracketed({0.5: 0.6, 1.0: 0.7, 2.0: 0.65}) == ([0.5, 1.0, 2.0], 1.0)
    assert widen_until_bracketed({0.5: 0.6, 1.0: 0.7, 2.0: 0.8, 4.0: 0.85, 8.0: None}) == \
        ([0.5, 1.0, 2.0, 4.0, 8.0], 4.0)
    # better and better lower down: `widen` factors of 2 past the sweep at most; every run
    # diverged: lower
    rising = {0.5 / 2 ** k: 0.1 * (1 + k) for k in range(8)}
    assert widen_until_bracketed({**rising, 1.0: None, 2.0: None}, widen=3) == \
        ([0.5, 1.0, 2.0, 0.25, 0.125, 0.0625], 0.0625)
    assert widen_until_bracketed({0.5: None, 1.0: None, 2.0: None, 0.25: None}, widen=1) == \
        ([0.5, 1.0, 2.0, 0.25], None)
    assert widen_until_bracketed({f: f for f in (0.5, 1.0, 2.0, 4.0)}, widen=1) == \
        ([0.5, 1.0, 2.0, 4.0], 4.0)
    # one factor (the digits' plan): no sweep, nothing past it
    assert widen_until_bracketed({1.0: 0.9}, lr_factors=(1.0,), widen=0) == ([1.0], 1.0)


def test_summary_reports_the_chosen_rate_and_keeps_the_sweep():
    grid = {("lars", 4096): ["l1", "l2", "l3"]}
    sweeps = {("lars", 4096): {0.5: "l0", 1.0: "l1", 2.0: "lx"}}
    results = {"l0": dict(top1=0.70, steps=52, skipped_steps=0),
               "l1": dict(top1=0.80, steps=52, skipped_steps=0),
               "l2": dict(top1=0.82, steps=52, skipped_steps=0),
               "l3": dict(top1=0.78, steps=52, skipped_steps=0), "lx": dict(diverged=True)}
    (row,) = study.summarise(grid, results, {("lars", 4096): 1.0}, sweeps)
    assert row["peak_lr"] == pytest.approx(study.peak_lr("lars", 4096))
    assert row["sweep"] == {0.5: 0.70, 1.0: 0.80, 2.0: None}
    assert row["top1_mean"] == pytest.approx(0.80) and row["runs"] == 3
    table = study.sweep_markdown([row])
    assert "| 4096 | lars | 70.0% | **80.0%** | diverged |" in table
    rows = list(csv.DictReader(study.sweep_csv([row]).splitlines()))
    assert [(r["lr_factor"], r["top1"], r["chosen"]) for r in rows] == \
        [("0.5", "0.7000", "0"), ("1", "0.8000", "1"), ("2", "diverged", "0")]
    # every rate diverged: no rate chosen, none named as the point's, drawn at 0
    results = dict(results, l0=dict(diverged=True), l1=dict(diverged=True))
    (row,) = study.summarise({("lars", 4096): ["l0"]}, results, {("lars", 4096): None}, sweeps)
    assert (row["lr_factor"], row["peak_lr"], row["diverged"]) == (None, None, 1)
    assert "| 4096 | lars | lars | fp32 | — | — | — | 1 (1 diverged) | — |" in \
        study.table_markdown([row])
    assert "**" not in study.sweep_markdown([row])
    assert [r["chosen"] for r in csv.DictReader(study.sweep_csv([row]).splitlines())] == \
        ["0", "0", "0"]
    assert list(csv.DictReader(study.table_csv([row]).splitlines()))[0]["peak_lr"] == ""
    from mpitrain.tools.plot import diverged_notes
    assert diverged_notes([row], "lars") == [(4096, 0.0, "lars: 1/1 diverged")]


def test_resume_keeps_a_run_of_the_same_options_and_ranks_however_its_paths_were_spelled(
        tmp_path, monkeypatch):
    """A run's record is compared by the files its data options named when it ran and
    name now, not by how they are spelled, wherever its --out lies now, and by the ranks
    its environment.json records, which --ranks-per-run sets."""
    run_dir = tmp_path / "moved" / "runs" / "sgd-b32-s0"        # the study's --out, renamed
    run_dir.mkdir(parents=True)
    for d in ("full", "part", "other"):
        (tmp_path / d).mkdir()
    (tmp_path / "data").symlink_to(tmp_path / "full")
    monkeypatch.chdir(tmp_path)
    # a data set by its name; a folder (or file) by what it is, whatever it is called
    (tmp_path / "digits").symlink_to(tmp_path / "full")
    assert study.files(dict(data="digits", data_dir="digits", epochs=4)) == \
        dict(data="digits", data_dir=str(tmp_path / "full"))
    earlier = study.train_options("sgd", 32, 0, 4, "digits", "out/runs/sgd-b32-s0")
    earlier["data_dir"] = "data"
    (run_dir / study.RESULT_FILE).write_text(json.dumps(dict(
        options=earlier, files=study.files(earlier), result=dict(top1=0.9))))
    (run_dir / "environment.json").write_text(json.dumps(dict(world_size=2)))
    options = dict(earlier, run_dir=str(run_dir), data_dir=str(tmp_path / "full"))
    monkeypatch.chdir(tmp_path / "other")
    assert study.kept_result(options, 2) == dict(top1=0.9)          # the same folder
    assert study.kept_result(options, 1) is None                   # another --ranks-per-run
    assert study.kept_result(dict(options, epochs=5), 2) is None   # other options
    # the same words from another directory, or a link since pointed elsewhere: other data
    assert study.kept_result(dict(options, data_dir="data"), 2) is None
    (tmp_path / "data").unlink()
    (tmp_path / "data").symlink_to(tmp_path / "part")
    assert study.kept_result(dict(options, data_dir=str(tmp_path / "data")), 2) is None


def test_time_left_guesses_each_run_from_runs_of_its_batch_size():
    took = {"a": (32, 100.0), "b": (32, 80.0), "c": (64, 50.0)}
    pending = [{"batch_size": 32}, {"batch_size": 128}]      # 90 s; 128: the mean of all, 230 / 3
    running = [({"batch_size": 64}, 20.0)]                    # 50 - 20 s left
    assert study.time_left(took, pending, running, 2) == pytest.approx((90 + 230 / 3 + 30) / 2)
    assert study.time_left(took, [], [({"batch_size": 32}, 120.0)], 2) == 0.0


def run_study(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "mpitrain", "study", "large-batch", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=launcher.environment())


def test_missing_or_foreign_data_file_is_refused_with_nothing_written(tmp_path):
    out = tmp_path / "out"
    r = run_study("--data", str(tmp_path / "nope.h5"), "--out", str(out), "--quick")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "nope.h5 does not exist" in r.stderr and "mpitrain convert" in r.stderr
    assert not out.exists()
    for name in ("text.h5", "text_val.h5"):
        (tmp_path / name).write_text("not HDF5")
    r = run_study("--data", str(tmp_path / "text.h5"), "--out", str(out), "--quick")
    assert r.returncode == 2 and "cannot be opened as HDF5" in r.stderr, r.stderr
    assert not out.exists()


def test_the_training_file_as_validation_file_is_refused_before_any_run(digits, tmp_path):
    """Every run would refuse it: the study started them, ended in a traceback, and left
    their logs, so that the next study into --out was refused as an earlier one."""
    out, train = tmp_path / "out", digits / "digits_train.h5"
    r = run_study("--data-dir", str(digits), "--val-data", str(train), "--out", str(out),
                  "--quick")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"validation file {train} is the training file" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def test_unwritable_out_is_refused_with_nothing_written(tmp_path):
    (tmp_path / "file").write_text("")
    r = run_study("--out", str(tmp_path / "file" / "out"), "--quick",
                  "--data-dir", str(tmp_path / "data"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "cannot be created" in r.stderr
    r = run_study("--out", str(tmp_path / "file"), "--quick", "--data-dir", str(tmp_path / "data"))
    assert r.returncode == 2 and "is a file, not a directory" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]      # digits not converted


def test_an_out_of_an_earlier_or_a_running_study_is_refused_with_nothing_removed(digits,
                                                                                tmp_path):
    """A fresh study would remove the earlier study's runs of its names: --resume keeps
    them. A study holds its --out while it runs (config.RunLock)."""
    from mpitrain.config import RunLock
    out = tmp_path / "out"
    kept = out / "runs" / "sgd-b32-s0" / "metrics.jsonl"
    kept.parent.mkdir(parents=True)
    kept.write_text("{}\n")
    r = run_study("--quick", "--out", str(out), "--data-dir", str(tmp_path / "data"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"--out {out} holds an earlier study's runs (1 under {out / 'runs'}): keep the " \
           f"results of those with the same options with --resume" in r.stderr, r.stderr
    assert kept.read_text() == "{}\n"
    assert not (tmp_path / "data").exists()            # refused before the digits' conversion
    assert sorted(os.listdir(out)) == ["runs"]
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with RunLock(str(fresh), flag="--out"):
        r = run_study("--quick", "--out", str(fresh), "--data-dir", str(digits))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"--out {fresh} is in use by a running job (host " in r.stderr, r.stderr
    assert "give another --out" in r.stderr and not (fresh / "runs").exists()
    # the runs of a study still running are not an earlier study's
    with RunLock(str(out), flag="--out"):
        r = run_study("--quick", "--out", str(out), "--data-dir", str(tmp_path / "data"))
    assert r.returncode == 2 and f"--out {out} is in use by a running job" in r.stderr, r.stderr
    assert not (tmp_path / "data").exists()
    assert kept.read_text() == "{}\n"


@pytest.mark.launches
@pytest.mark.parametrize("sig, status, run_says", [
    (signal.SIGTERM, 143, "SIGTERM: stopped at epoch "),       # scancel, kill
    (signal.SIGKILL, -signal.SIGKILL, "MPITRAIN_LAUNCHER_PID) is gone"),
], ids=["sigterm", "kill-9"])
def test_the_runs_of_a_stopped_study_end(tmp_path, sig, status, run_says):
    """SIGTERM to a study ends it as Ctrl-C does: its runs stop with a checkpoint, and it
    says so and exits 143 (it died without a word). After kill -9, which it cannot catch,
    its runs' ranks see it gone and end their jobs."""
    from launcher import BackgroundJob
    from test_openmpi import wait_until_gone
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "mpitrain", "study", "large-batch", "--quick", "--ranks", "1",
           "--epochs", "50", "--out", str(out), "--data-dir", str(tmp_path / "data")]
    job = BackgroundJob(cmd, out / "runs" / "sgd-b32-s0", tmp_path / "log", ranks=1,
                        env=launcher.environment())
    try:
        board = job.running()
        job.proc.send_signal(sig)
        ended, _, said = job.finish(timeout=60)
        assert ended == status, (ended, said)
        assert ("mpitrain: terminated, ending the job" in said) == (sig == signal.SIGTERM), said
        assert wait_until_gone([board[0]["pid"]], timeout=30) < 15
        assert run_says in (out / "runs" / "sgd-b32-s0" / "log.txt").read_text()
    finally:
        job.cleanup()


@pytest.mark.launches
@pytest.mark.one_mpi
def test_quick_study_end_to_end(tmp_path):
    out = tmp_path / "out"
    # 2 epochs, not --quick's 4: the same grid, in half the time
    r = run_study("--quick", "--epochs", "2", "--out", str(out), "--data-dir",
                  str(tmp_path / "data"), timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"\[12/12 runs, 12/12 points\] .* left about 0:00", r.stdout)
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(int(r["batch"]), r["config"]) for r in rows} == \
        {(b, c) for b in (32, 128, 512) for c in study.PLANS["digits"]["recipes"]}
    for row in rows:
        assert 0.0 <= float(row["top1_mean"]) <= 1.0, row
        assert int(row["steps"]) == 2 * (1438 // int(row["batch"]))
    sgd32 = next(r for r in rows if r["config"] == "sgd" and r["batch"] == "32")
    assert float(sgd32["top1_mean"]) > 0.8                     # chance: 0.1
    markdown = (out / "results.md").read_text()
    assert markdown.count("\n| 512 |") == 4 and "lars-fp16" in markdown
    assert re.search(r"; 12 runs in \d+:\d\d \(min:s\)\.\n", markdown)
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob("*.tmp*")) and not (out / ".lock").exists()
    # every run's command, and one of them re-made: the same top-1, bit for bit
    lines = [x for x in (out / "commands.sh").read_text().splitlines() if not x.startswith("#")]
    assert len(lines) == 12 and all("-m mpitrain train" in x for x in lines)
    line = next(x for x in lines if "lamb-b512-s0" in x)
    command, top1 = line.split("  # top-1 ")
    rerun = tmp_path / "rerun"
    command = command.replace(shlex.quote(str(out / "runs" / "lamb-b512-s0")), str(rerun))
    r = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=300,
                       env=launcher.environment())
    assert r.returncode == 0, r.stdout + r.stderr
    evals = [x for x in (rerun / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert f"{float(re.search(r'top1.: ([0-9.]+)', evals[-1]).group(1)):.4f}" == top1
    # a study stopped with one run unfinished: --resume runs that one alone, and the table
    # comes out the same
    table = (out / "results.csv").read_text()
    (out / "runs" / "lars-b128-s0" / study.RESULT_FILE).unlink()
    env_file = out / "runs" / "sgd-b32-s0" / "environment.json"     # one kept run's code
    env = json.loads(env_file.read_text())
    assert env["source"] and env["source"] != "0123456789ab"
    env_file.write_text(json.dumps(dict(env, source="0123456789ab")))
    r = run_study("--quick", "--epochs", "2", "--resume", "--out", str(out), "--data-dir",
                  str(tmp_path / "data"), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "11 of 12 runs ended in an earlier study" in r.stdout
    other = (f", 1 of them made by other code than this checkout's ({env['source']}): "
             f"0123456789ab")
    assert other in r.stdout
    assert re.search(r"\[12/12 runs, 12/12 points\] lars-b128-s0", r.stdout)
    assert (out / "results.csv").read_text() == table
    header = (out / "results.md").read_text()
    assert re.search(r"; 1 run in \d+:\d\d \(min:s\), 11 more kept from an earlier study "
                     r"\(--resume\)" + re.escape(other) + r"\.\n", header)
