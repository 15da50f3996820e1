"""Metrics around the loop: the timeline and its Chrome-trace file, metrics.jsonl,
the progress display, the YAML configuration, and `plot`."""
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from launcher import BackgroundJob, JobEnded, environment, signal_as_step_starts
from mpitrain.cli import apply_config_file, build_parser
from mpitrain.metrics import (LossMean, MetricsLog, StepProgress, Timeline, read_metrics,
                              trace_path)


# ----- timeline -----
def test_trace_path():
    assert trace_path("out/trace.json", 3) == "out/trace.rank3.json"
    assert trace_path("out/trace", 0) == "out/trace.rank0.json"
    assert trace_path("out/", 1) == os.path.join("out/", "trace.rank1.json")


def test_timeline_spans_nest_and_come_from_threads(tmp_path):
    t = Timeline(str(tmp_path / "t.json"), rank=2)
    with t.span("step", "step"):
        with t.span("forward", "forward"):
            time.sleep(0.02)

    def comm():
        with t.span("bucket 0", "comm"):
            time.sleep(0.01)
    worker = threading.Thread(target=comm)
    worker.start()
    worker.join()
    path = t.save()
    assert path == str(tmp_path / "t.rank2.json")
    events = json.load(open(path))["traceEvents"]
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    assert set(spans) == {"step", "forward", "bucket 0"}
    assert all(e["pid"] == 2 for e in events)
    outer, inner = spans["step"], spans["forward"]
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    assert inner["dur"] >= 20000                       # microseconds
    assert len({e["tid"] for e in spans.values()}) == 3    # one row per category
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {"step", "forward", "comm"}
    totals = t.take_totals()
    assert totals["forward"] >= 0.02 and totals["comm"] >= 0.01
    assert t.take_totals() == {}                       # reset by the previous call


def test_activity_names_the_innermost_open_span():
    t = Timeline()
    assert t.activity() is None
    with t.span("step 3", "step"):
        with t.span("all-reduce", "comm"):
            assert t.activity() == "in 'all-reduce' for 0 s"
        assert t.activity().startswith("in 'step 3'")
    assert t.activity() is None


def test_timeline_off_records_nothing(tmp_path):
    t = Timeline.off()
    with t.span("forward", "forward"):
        pass
    assert t.take_totals() == {} and t.save() is None
    timing_only = Timeline()                           # phase times, no file
    with timing_only.span("forward", "forward"):
        pass
    assert set(timing_only.take_totals()) == {"forward"} and timing_only.save() is None


# ----- metrics.jsonl and progress -----
def test_metrics_log_appends_and_reader_skips_a_torn_line(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    log = MetricsLog(path)
    log.write({"kind": "step", "loss": 1.5})
    log.close()
    log = MetricsLog(path)                             # a resumed run continues the file
    log.write({"kind": "eval", "top1": 0.5})
    log.close()
    with open(path, "a") as f:
        f.write('{"kind": "st')                       # a crash in the middle of a line
    assert read_metrics(path) == [{"kind": "step", "loss": 1.5}, {"kind": "eval", "top1": 0.5}]


def test_the_loss_mean_weighs_every_step_alike_across_a_resume_on_other_ranks():
    """A rank's loss is the mean over its share of the global batch: on 2 ranks it weighs
    half a step, on 1 a whole one, also when a record's steps ran partly before a resume
    on another number of ranks (the sums travel in the checkpoint as JSON)."""
    two = LossMean()
    two.add(1.0 + 3.0, 2, 0)
    two.add(5.0, 2, 1)                          # the other rank's loss was not finite
    one = LossMean()
    one.load_state_dict(json.loads(json.dumps(two.state_dict())), world_size=2)
    one.add(8.0, 1, 0)
    loss, finite, not_finite = one.take()
    assert loss == pytest.approx((1.0 / 2 + 3.0 / 2 + 5.0 / 2 + 8.0) / (1 + 1 / 2 + 1))
    assert (finite, not_finite) == (4, 1)
    assert one.take() == (None, 0, 0)           # counted from zero again
    # older checkpoints' sums: the ranks' finite losses summed, their count (and the others')
    for sums in ([4.0, 2, 0], [4.0, 2]):
        old = LossMean()
        old.load_state_dict(sums, world_size=2)
        old.add(8.0, 1, 0)
        assert old.take() == (pytest.approx((2.0 + 8.0) / 2), 3, 0)


def test_progress_prints_plain_lines_off_a_terminal():
    out = io.StringIO()
    p = StepProgress(100, 0, stream=out)
    assert not p.tty
    p.update(10)
    assert out.getvalue() == ""                        # only logged steps print
    p.update(20, "loss 0.5")
    p.line("epoch 1/2 done")
    p.close()
    lines = out.getvalue().split("\n")
    assert re.fullmatch(r"loss 0\.5  ETA \d\d:\d\d", lines[0]), lines
    assert lines[1:] == ["epoch 1/2 done", ""]
    assert "\r" not in out.getvalue() and "\033" not in out.getvalue()


# ----- --config -----
def parse_with_config(tmp_path, text, *flags):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    argv = ["train", "--config", str(path), *flags]
    parser = build_parser()
    args = parser.parse_args(argv)
    apply_config_file(args, parser, argv)
    return args


def test_yaml_values_apply_and_flags_win(tmp_path):
    args = parse_with_config(tmp_path, "epochs: 3\nbatch-size: 64\nlr: 0.05\nnesterov: true\n"
                                       "checkpoint_every: 2\n", "--lr", "0.2")
    assert (args.epochs, args.batch_size, args.nesterov, args.checkpoint_every) == (3, 64, True, 2)
    assert args.lr == 0.2                              # given on the command line: it wins
    # a flag given with its default value still wins over the file
    assert parse_with_config(tmp_path, "epochs: 3\n", "--epochs", "8").epochs == 8


@pytest.mark.parametrize("text,message", [
    ("epochs: 3\nbogus: 1\n", "unknown option 'bogus'"),
    ("epochs: -1\n", "epochs: -1 must be >= 1"),
    ("model: vgg\n", "model: 'vgg': choose from"),
    ("- 1\n- 2\n", "must hold a mapping"),
    ("epochs: [\n", "is not valid YAML: expected the node content, but found '<stream end>' "
                    "(line 2, column 1)"),
    ("epochs: 2\n  lr: [0.1\n", "is not valid YAML: mapping values are not allowed here "
                                "(line 2, column 5)"),
])
def test_bad_yaml_is_refused_by_name(tmp_path, capsys, text, message):
    """In one line, the reason and where it is."""
    with pytest.raises(SystemExit) as e:
        parse_with_config(tmp_path, text)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("text,flags,said", [
    ("optimizer: sgd\nlars_eta: 0.01\nepochs: 2\n", (),
     "drop --lars-eta (or add --optimizer lars) (set by --config PATH: optimizer, lars_eta)\n"),
    ("lars_eta: 0.01\n", ("--optimizer", "sgd"),
     "drop --lars-eta (or add --optimizer lars) (set by --config PATH: lars_eta)\n"),
    ("lr: 0.2\n", ("--schedule", "step"),          # the file names nothing refused
     "(for example --milestones 30 60 80)\n"),
    ("data: no/such.h5\n", (), "convert ...` (set by --config PATH: data)\n"),
    ("batch_size: 2000\n", (),                    # refused by the run, against the data
     "an epoch would have no step (set by --config PATH: batch_size)\n"),
])
def test_a_refusal_of_options_from_the_config_file_says_they_came_from_it(
        tmp_path, text, flags, said):
    """The rules between options name each by its flag; those the file set, the refusal
    says came from it (the run's checks, and those of the command line before them)."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    r = subprocess.run([sys.executable, "-m", "mpitrain", "train", "--config", str(path),
                        "--run-dir", str(tmp_path / "run"), *flags], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.endswith(said.replace("PATH", str(path))), r.stderr
    assert r.stderr.count("\n") == 1 and ("set by" in r.stderr) == ("set by" in said)


# ----- plot -----
def test_the_training_loss_is_labelled_with_its_label_smoothing(tmp_path):
    """The training loss is that of the smoothed targets, beside a validation loss of the
    labels: its curve says so."""
    from mpitrain.tools.plot import train_loss_label
    assert train_loss_label(str(tmp_path)) == "train loss"           # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"label_smoothing": 0.1}))
    assert train_loss_label(str(tmp_path)) == "train loss (label smoothing 0.1)"
    (tmp_path / "config.json").write_text(json.dumps({"label_smoothing": 0.0}))
    assert train_loss_label(str(tmp_path)) == "train loss"


def test_plot_draws_the_curves(tmp_path):
    pytest.importorskip("matplotlib")
    from mpitrain.tools.plot import PlotError, plot_run
    log = MetricsLog(str(tmp_path / "metrics.jsonl"))
    for epoch in (1, 2, 3):
        for step in (5, 10):
            g = (epoch - 1) * 10 + step
            log.write(dict(kind="step", epoch=epoch, step=step, global_step=g, loss=2.0 / g,
                           lr=0.1 * g / 30, loss_scale=None, images_per_s=500 + 10 * g,
                           time=dict(data=0.001, forward=0.01, backward=0.02, comm=0.005,
                                     bucket=0.015, update=0.001)))
        log.write(dict(kind="eval", epoch=epoch, global_step=10 * epoch, top1=0.3 * epoch,
                       top5=0.33 * epoch))
    log.close()
    paths = plot_run(str(tmp_path), str(tmp_path / "png"))
    assert [os.path.basename(p) for p in paths] == ["loss.png", "accuracy.png", "lr.png",
                                                    "throughput.png"]
    from PIL import Image
    for p in paths:
        with Image.open(p) as im:
            assert im.format == "PNG" and im.size == (640, 400)
            assert len(im.convert("RGB").getcolors(1 << 16)) > 20    # not a blank canvas
    with pytest.raises(PlotError, match="does not exist"):
        plot_run(str(tmp_path / "png"))
    # the run's metrics.jsonl named instead of its directory: the same run
    assert plot_run(str(tmp_path / "metrics.jsonl"), str(tmp_path / "again")) == \
        [str(tmp_path / "again" / os.path.basename(p)) for p in paths]
    assert sorted(os.listdir(tmp_path / "png")) == sorted(map(os.path.basename, paths))  # whole
    # an --out that is a file, or lies under one: refused before anything is drawn
    with pytest.raises(PlotError, match=f"--out {paths[0]} is a file; give a directory"):
        plot_run(str(tmp_path), paths[0])
    with pytest.raises(PlotError, match=f"{paths[0]} is a file, so .* cannot be written"):
        plot_run(str(tmp_path), os.path.join(paths[0], "more"))


def test_plot_says_which_curves_a_run_did_not_record(tmp_path, monkeypatch):
    """Records with a null training accuracy (an older run's CUDA graphs), an older
    metrics.jsonl no field at all, a run whose every loss was not finite: the plot draws
    the rest and says why on the axes."""
    pytest.importorskip("matplotlib")
    from mpitrain.tools import plot
    said = []
    monkeypatch.setattr(plot, "missing", lambda ax, text: said.append(text))
    for name, top1 in (("graphs", dict(top1=None)), ("older", {}),
                       ("diverged", dict(top1=0.1, loss=None))):
        run_dir = tmp_path / name
        run_dir.mkdir()
        log = MetricsLog(str(run_dir / "metrics.jsonl"))
        for g in (5, 10):
            log.write({**dict(kind="step", epoch=1, step=g, global_step=g, loss=1.0 / g,
                              lr=0.1, images_per_s=100.0, time={}), **top1})
        log.write(dict(kind="eval", epoch=1, global_step=10, top1=0.5, top5=0.9,
                       **({"loss": None} if top1 else {})))
        log.close()
        assert len(plot.plot_run(str(run_dir))) == 4
    assert said == ["validation loss not finite",
                    "training accuracy not recorded: null in these records (an older run "
                    "with --cuda-graph)",
                    "validation loss not in this metrics.jsonl (an older run)",
                    "training accuracy not recorded: not in this metrics.jsonl (an older run)",
                    "training loss not finite; validation loss not finite"]


def test_throughput_stacks_the_phases_that_add_up_to_the_step():
    """The all-reduce's own time ("bucket") runs behind backward, or within the step's
    wait for it, "comm": stacking both would count the communication twice."""
    from mpitrain.tools.plot import stacked_phases
    steps = [dict(time=dict(forward=0.01, backward=0.02, comm=0.005, bucket=0.015,
                            update=0.001))]
    assert stacked_phases(steps) == ["backward", "comm", "forward", "update"]


def test_progress_bar_redraws_in_place_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True
    out = Terminal()
    p = StepProgress(10, 0, stream=out)
    p.update(5, "loss 1.0")
    drawn = out.getvalue()
    assert drawn.startswith("\r") and "loss 1.0  ETA" in drawn and "\n" not in drawn
    assert "#" * 12 in drawn or "\u2588" * 12 in drawn     # half of the 24-wide bar
    p.line("epoch 1/2 done")
    assert "epoch 1/2 done\n" in out.getvalue()[len(drawn):]
    p.close()


# ----- a real run: training accuracy, validation loss, the parameter count -----
def test_train_step_counts_the_top1_hits_of_the_logits_it_trains_on():
    """`correct` gains, step after step, the images whose label is the top logit of the
    forward pass the step trains on (train mode: the batch's own statistics)."""
    from mpi4py import MPI

    from mpitrain.comm import Communicator
    from mpitrain.comm.buckets import Reducer
    from mpitrain.nets import build_model
    from mpitrain.nets.losses import accuracy_counts
    from mpitrain.optim import make_optimizer
    from mpitrain.train import train_step
    model = build_model("resnet_small", num_classes=10)
    opt = make_optimizer("sgd", model.arena, momentum=0.9)
    reducer = Reducer(model.arena, Communicator(MPI.COMM_SELF))
    x = np.random.default_rng(0).standard_normal((8, 32, 32, 3)).astype(np.float32)
    correct, expected = np.zeros(1, np.int64), 0
    for step in range(2):
        y = model.forward(x, train=True).argmax(axis=1)
        y[::2] = (y[::2] + 1) % 10                       # half of them wrong
        if step:
            y[1] = (y[1] + 1) % 10                       # and one more
        expected += int(accuracy_counts(model.forward(x, train=True), y, topk=(1,))[0])
        train_step(model, opt, reducer, x, y, lr=0.1, correct=correct)
        assert correct[0] == expected == (4, 7)[step]
    reducer.close()


def mpitrain_quick(*args):
    """`python -m mpitrain ARGS`: one process, no mpiexec (MPI starts as a singleton)."""
    return subprocess.run([sys.executable, "-m", "mpitrain", *args], capture_output=True,
                          text=True, timeout=300, env=environment(1))


@pytest.fixture(scope="module")
def digits_run(digits, tmp_path_factory):
    """A two-epoch resnet_small run on the digits: its directory and its output."""
    run_dir = tmp_path_factory.mktemp("digits-run") / "run"
    r = mpitrain_quick("train", "--batch-size", "64", "--seed", "5", "--epochs", "2",
                       "--data-dir", str(digits), "--run-dir", str(run_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    return run_dir, r.stdout


def test_a_run_records_and_plots_validation_loss_and_training_accuracy(digits_run, digits,
                                                                        tmp_path):
    run_dir, out = digits_run
    records = read_metrics(str(run_dir / "metrics.jsonl"))
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["epoch"] for r in steps] == [r["epoch"] for r in evals] == [1, 2]
    # the training top-1 of the 22 x 64 images of each epoch, which the model learns
    assert all(0 < r["top1"] <= 1 and (r["top1"] * 22 * 64).is_integer() for r in steps)
    assert steps[1]["top1"] > steps[0]["top1"] + 0.2
    # the validation set's mean cross-entropy, which falls as the top-1 rises
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in evals)
    assert evals[1]["loss"] < evals[0]["loss"] and evals[1]["top1"] > evals[0]["top1"]
    # eval of the last checkpoint scores the same set with the same model
    r = mpitrain_quick("eval", "--checkpoint", str(run_dir), "--data",
                       str(digits / "digits_val.h5"), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["loss"] == pytest.approx(evals[1]["loss"], rel=1e-5)
    # the progress and epoch lines say both
    assert f"top1 {steps[1]['top1']:.1%}" in out and f"val loss {evals[1]['loss']:.4f}" in out
    pytest.importorskip("matplotlib")
    from mpitrain.tools.plot import plot_run
    paths = plot_run(str(run_dir), str(tmp_path / "png"))
    assert [os.path.basename(p) for p in paths] == ["loss.png", "accuracy.png", "lr.png",
                                                    "throughput.png"]
    for p in paths:
        assert os.path.getsize(p) > 0 and open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_train_inspect_and_export_print_one_parameter_count(digits_run, digits, tmp_path):
    """resnet_small on the digits: 10 classes wherever its size is printed; inspect
    takes them from --data as train does, and train's model without --model (without
    --data it says it assumed 1000)."""
    run_dir, out = digits_run
    count = "78,042 parameters (10 classes)"
    assert f"mpitrain: resnet_small, {count}, on " in out
    r = mpitrain_quick("inspect", "--data", "digits", "--data-dir", str(digits))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"total parameters:    {count}\n" in r.stdout
    assert r.stdout.startswith("resnet_small: input (32, 32, 3), 10 classes (from ")
    fresh = tmp_path / "data"           # a named data set is converted on first use, as train does
    r = mpitrain_quick("inspect", "--model", "resnet_small", "--data", "digits", "--data-dir",
                       str(fresh))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"mpitrain: converting digits into {fresh}/\nresnet_small: "
                               f"input (32, 32, 3), 10 classes (from {fresh}/digits_train.h5)")
    r = mpitrain_quick("inspect", "--model", "resnet_small", "--image-size", "32")
    assert "1000 classes (by default; --data or --num-classes" in r.stdout
    assert "142,392 parameters (1000 classes)" in r.stdout
    r = mpitrain_quick("export", str(run_dir), "--format", "safetensors",
                       str(tmp_path / "m.safetensors"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resnet_small, {count}, input 32x32" in r.stdout


def test_an_epoch_of_many_steps_logs_four_lines_with_the_rate_it_applies(digits, tmp_path):
    """Without --log-every an epoch of 100 steps or more writes 4 records (179 steps: 45,
    90, 135 and the last); a small learning rate is printed as it is, not as 0.0000."""
    run_dir = tmp_path / "run"
    r = mpitrain_quick("train", "--batch-size", "8", "--epochs", "1", "--optimizer", "lamb",
                       "--lr", "0.00004", "--schedule", "constant", "--data-dir", str(digits),
                       "--run-dir", str(run_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    steps = [rec for rec in read_metrics(str(run_dir / "metrics.jsonl"))
             if rec["kind"] == "step"]
    assert [rec["step"] for rec in steps] == [45, 90, 135, 179]
    assert steps[-1]["lr"] == pytest.approx(4e-5)
    assert re.search(r"step 179/179 .* lr 4e-05 ", r.stdout), r.stdout


def test_a_stop_between_two_log_lines_resumes_with_the_same_training_accuracy(digits,
                                                                                tmp_path):
    """The top-1 hits and images counted since the last log line travel in the
    checkpoint, as the loss does: a run stopped in the middle of an interval and resumed
    writes the uninterrupted run's records, timings aside."""
    job = ("train", "--batch-size", "64", "--seed", "5", "--epochs", "1", "--log-every", "5",
           "--data-dir", str(digits))
    straight = tmp_path / "straight"
    r = mpitrain_quick(*job, "--run-dir", str(straight))
    assert r.returncode == 0, r.stdout + r.stderr
    for attempt in range(3):                            # a step may slip past the stop
        run_dir = tmp_path / f"stopped{attempt}" / "run"
        j = BackgroundJob([sys.executable, "-m", "mpitrain", *job, "--run-dir", str(run_dir)],
                          run_dir, tmp_path / f"log{attempt}", ranks=1)
        try:
            # it takes the signal in step 13 and stops after it: steps 11 to 13 are counted,
            # not yet logged
            status, _, out = signal_as_step_starts(j, 13)
        except JobEnded:                                # the polls missed step 13's start
            continue
        finally:
            j.cleanup()
        assert status == 0, out
        if re.search(r"SIGUSR1: stopped at epoch 1, step 1[1-4];", out):
            break
    else:
        pytest.fail("the signal never landed between two log lines")
    r = mpitrain_quick(*job, "--run-dir", str(run_dir), "--resume", "auto")
    assert r.returncode == 0, r.stdout + r.stderr

    def records(run_dir):
        return [{k: v for k, v in rec.items() if k not in ("time", "images_per_s")}
                for rec in read_metrics(str(run_dir / "metrics.jsonl"))]
    assert records(run_dir) == records(straight)
    steps = [rec for rec in records(straight) if rec["kind"] == "step"]
    assert [rec["step"] for rec in steps] == [5, 10, 15, 20, 22]
    assert all(0 < rec["top1"] <= 1 for rec in steps)


@pytest.mark.parametrize("removed", [("044",), ("044", "022")], ids=["one", "all"])
def test_a_run_resumed_from_an_earlier_checkpoint_writes_each_step_once(digits, tmp_path,
                                                                       removed):
    """A run that went past its last checkpoint before it stopped (a crash: here the newer
    checkpoint is removed) and is resumed: the records of the steps it runs again replace
    the earlier ones, so metrics.jsonl is the uninterrupted run's, timings aside; its
    final line says its seconds are since the resume. With every checkpoint gone the
    resume starts from the beginning, and every earlier record goes."""
    job = ("train", "--batch-size", "64", "--seed", "5", "--epochs", "2", "--log-every", "10",
           "--data-dir", str(digits))
    straight, run_dir = tmp_path / "straight", tmp_path / "run"
    for d in (straight, run_dir):
        r = mpitrain_quick(*job, "--run-dir", str(d))
        assert r.returncode == 0, r.stdout + r.stderr
    for step in removed:
        (run_dir / f"checkpoint-000000{step}.h5").unlink()
    r = mpitrain_quick(*job, "--run-dir", str(run_dir), "--resume", "auto")
    assert r.returncode == 0, r.stdout + r.stderr
    if removed == ("044",):
        assert "resumed from" in r.stdout and "checkpoint-000000022.h5" in r.stdout
        # the seconds of the final line are this job's
        assert re.search(r"\(359 images, 2 epochs, [0-9.]+ s since the resume at epoch 2, "
                         r"step 0\)", r.stdout), r.stdout
    else:
        assert f"no checkpoint in {run_dir}: starting from the beginning" in r.stdout

    def records(run_dir):
        return [{k: v for k, v in rec.items() if k not in ("time", "images_per_s")}
                for rec in read_metrics(str(run_dir / "metrics.jsonl"))]
    assert records(run_dir) == records(straight)
    assert [(rec["kind"], rec["global_step"]) for rec in records(run_dir)] == [
        ("step", 10), ("step", 20), ("step", 22), ("eval", 22),
        ("step", 32), ("step", 42), ("step", 44), ("eval", 44)]


def test_eval_and_validation_normalise_as_the_model_was_trained(digits_run, digits, tmp_path):
    """A validation file whose recorded mean and std are not the training file's (a test
    set converted apart) is scored on the training file's normalisation, which the model
    learnt: the same images give the same scores in eval and in train's validation."""
    import shutil

    import h5py
    run_dir, _ = digits_run
    val, other = digits / "digits_val.h5", tmp_path / "other_val.h5"
    shutil.copy(val, other)
    with h5py.File(other, "r+") as f:
        f["mean"][...] = f["mean"][:] * 1.6
        f["std"][...] = f["std"][:] * 0.8
    scores = []
    for path in (val, other):
        r = mpitrain_quick("eval", "--checkpoint", str(run_dir), "--data", str(path), "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        scores.append({k: v for k, v in json.loads(r.stdout).items() if k != "data"})
    assert scores[0] == scores[1] and scores[0]["top1"] > 0.5, scores
    finals = []
    for path in (val, other):
        r = mpitrain_quick("train", "--data-dir", str(digits), "--val-data", str(path),
                           "--epochs", "1", "--batch-size", "64", "--run-dir",
                           str(tmp_path / path.stem))
        assert r.returncode == 0, r.stdout + r.stderr
        finals.append(re.search(r"final validation accuracy: .*\(", r.stdout).group(0))
    assert finals[0] == finals[1], finals
