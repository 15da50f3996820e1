"""Metrics around the loop: the timeline and its Chrome-trace file, metrics.jsonl,
the progress display, the YAML configuration, and `plot`."""
import io
import json
import os
import re
import threading
import time

import pytest

from mpitrain.cli import apply_config_file, build_parser
from mpitrain.metrics import MetricsLog, StepProgress, Timeline, read_metrics, trace_path


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
    ("epochs: [\n", "is not valid YAML"),
])
def test_bad_yaml_is_refused_by_name(tmp_path, capsys, text, message):
    with pytest.raises(SystemExit) as e:
        parse_with_config(tmp_path, text)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


# ----- plot -----
def test_plot_draws_the_curves(tmp_path):
    pytest.importorskip("matplotlib")
    from mpitrain.plot import PlotError, plot_run
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


def test_throughput_stacks_the_phases_that_add_up_to_the_step():
    """The all-reduce's own time ("bucket") runs behind backward; the step's wait for it
    is "comm": stacking both would count the communication twice."""
    from mpitrain.plot import stacked_phases
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
