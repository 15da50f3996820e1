"""The train options are declared once (mpitrain/options.py): the command line, YAML
files, Config and the docs' table are all made from that table."""
import os

import pytest
import yaml

from mpitrain.options import BY_NAME, DEFAULTS, OPTIONS, Config, markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_docs_table_is_the_one_the_declarations_make():
    with open(os.path.join(ROOT, "docs", "train-options.md")) as f:
        assert f.read() == markdown(), \
            "docs/train-options.md is stale: python -m mpitrain.options > docs/train-options.md"


def test_every_option_is_a_train_flag_with_its_default():
    from mpitrain.cli import build_parser
    args = vars(build_parser().parse_args(["train"]))
    for option in OPTIONS:
        assert args[option.name] == option.default, option.name
    assert set(args) - set(DEFAULTS) == {"command", "command_parser", "config"}


def test_the_choices_are_those_of_the_code_that_takes_them():
    from mpitrain.comm import ALGORITHMS
    from mpitrain.datasets.augment import RATIO, SCALE
    from mpitrain.nets import MODELS
    from mpitrain.optim import OPTIMIZERS
    from mpitrain.options import CROP_RATIO, CROP_SCALE
    assert BY_NAME["allreduce"].choices == ALGORITHMS
    assert set(BY_NAME["model"].choices) == set(MODELS)
    assert set(BY_NAME["optimizer"].choices) == set(OPTIMIZERS)
    assert (CROP_SCALE, CROP_RATIO) == (SCALE, RATIO)


@pytest.mark.parametrize("flag_value,python_value", [
    (["--lr", "0.05"], dict(lr=0.05)),
    (["--milestones", "3", "6"], dict(milestones=[3, 6])),
    (["--crop-scale", "0.35", "1"], dict(crop_scale=(0.35, 1.0))),
    (["--fusion-threshold", "auto"], dict(fusion_threshold="auto")),
    (["--loss-scale", "dynamic"], dict(loss_scale="dynamic")),
    (["--no-overlap"], dict(overlap=False)),
    (["--shard-update"], dict(shard_update=True)),
])
def test_a_value_means_the_same_as_a_flag_in_yaml_and_in_python(flag_value, python_value,
                                                                 tmp_path):
    from mpitrain.cli import apply_config_file, build_parser
    parser = build_parser()
    from_flag = Config(**{k: v for k, v in vars(parser.parse_args(["train", *flag_value]))
                          .items() if k in DEFAULTS})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({k.replace("_", "-"): list(v) if isinstance(v, tuple) else v
                                    for k, v in python_value.items()}))
    argv = ["train", "--config", str(path)]
    args = parser.parse_args(argv)
    apply_config_file(args, parser, argv)
    from_yaml = Config(**{k: v for k, v in vars(args).items() if k in DEFAULTS})
    assert from_flag == from_yaml == Config(**python_value)
    assert from_flag.changed() == {k: tuple(v) if isinstance(v, list) else v
                                   for k, v in python_value.items()}


@pytest.mark.parametrize("values,message", [
    (dict(lr=0), "--lr: 0 must be > 0.0"),
    (dict(epochs=2.5), "--epochs: '2.5' is not a valid int"),
    (dict(model="resnet7"), "--model: 'resnet7': choose from"),
    (dict(crop_scale=[0.5]), "--crop-scale: .*2 values expected"),
    (dict(nesterov="yes"), "--nesterov: 'yes' is not true or false"),
    (dict(density=0), "--density: 0 must be > 0.0"),
    (dict(loss_scale=1e39), "--loss-scale: '1e\\+39' is beyond fp32's range"),
    (dict(batchsize=64), "unknown training options: batchsize"),
])
def test_a_bad_value_is_refused_naming_its_flag(values, message):
    with pytest.raises(ValueError, match=message):
        Config(**values)


def test_poly_power_shapes_the_learning_rate_of_a_run(digits, tmp_path):
    """--schedule poly --poly-power 1: each logged step's rate is the linear decay's
    (optim.learning_rate with power 1), not the default power 2's."""
    import subprocess
    import sys

    from launcher import environment
    from mpitrain.metrics import read_metrics
    from mpitrain.optim import learning_rate
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "mpitrain", "train", "--data-dir", str(digits),
                        "--run-dir", str(run_dir), "--epochs", "2", "--batch-size", "128",
                        "--schedule", "poly", "--poly-power", "1", "--warmup-epochs", "0",
                        "--log-every", "3", "--model", "resnet_small"],
                       capture_output=True, text=True, timeout=300, env=environment(1))
    assert r.returncode == 0, r.stdout + r.stderr
    steps = [s for s in read_metrics(str(run_dir / "metrics.jsonl")) if s["kind"] == "step"]
    per_epoch = max(s["step"] for s in steps)
    assert len(steps) >= 3
    for s in steps:
        at = s["epoch"] - 1 + s["step"] / per_epoch
        assert s["lr"] == pytest.approx(learning_rate(at, 0.1, 2, 0.0, "poly", power=1.0))
        if 0 < at < 2:
            assert s["lr"] != pytest.approx(learning_rate(at, 0.1, 2, 0.0, "poly"))


PATHS = ("--data", "--val-data", "--data-dir", "--run-dir", "--resume", "--trace", "--config")


@pytest.mark.parametrize("flag", PATHS)
def test_an_empty_path_is_refused_naming_its_option(flag, capsys):
    """'' names no file: taken as given it fell back to a default without a word, or (as
    --resume) put the run into the parent of the current directory."""
    from mpitrain.cli import build_parser
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["train", flag, ""])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert f"error: argument {flag}: '' is an empty path, which names no file or directory: " \
           f"give a name\n" in err, err


def test_an_empty_resume_writes_nothing_outside_the_current_directory(digits, tmp_path):
    """The data-loss case: `train --resume ''` trained into the parent of the current
    directory."""
    import subprocess
    import sys

    from launcher import environment
    here = tmp_path / "here"
    here.mkdir()
    r = subprocess.run([sys.executable, "-m", "mpitrain", "train", "--resume", "",
                        "--data-dir", str(digits), "--epochs", "1", "--batch-size", "128"],
                       capture_output=True, text=True, timeout=300, env=environment(1), cwd=here)
    assert r.returncode == 2 and "argument --resume: '' is an empty path" in r.stderr, \
        r.stdout + r.stderr
    assert os.listdir(tmp_path) == ["here"] and os.listdir(here) == []


@pytest.mark.parametrize("line,message", [
    ("data: null", "data: null is not a path: give a name, or leave the key out for its "
                   "default"),
    ("data: 5", "data: 5 is not a path: write a name as text, in quotes where it would read "
                "as a number ('5')"),
    ("data_dir: null", "data_dir: null is not a path"),
    ("run_dir: 7", "run_dir: 7 is not a path"),
    ("resume: 7", "resume: 7 is not a path"),
    ("val_data: 3", "val_data: 3 is not a path"),
    ("trace: ''", "trace: '' is an empty path"),
    ("crop-ratio: [1, .inf]", "crop_ratio: inf is not a finite number"),
])
def test_a_yaml_value_that_is_no_path_is_refused_by_the_options_type(line, message, tmp_path,
                                                                       capsys):
    """YAML gives a number or null where a flag gives text: each path option's type sees it
    as YAML typed it (it ended in a traceback)."""
    from mpitrain.cli import apply_config_file, build_parser
    path = tmp_path / "run.yaml"
    path.write_text(line + "\n")
    parser = build_parser()
    argv = ["train", "--config", str(path)]
    args = parser.parse_args(argv)
    with pytest.raises(SystemExit) as exit_:
        apply_config_file(args, parser, argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"error: config file {path}: {message}" in err, err


@pytest.mark.parametrize("text,message", [
    ("epochs: 1\nepochs: 2\n", "'epochs' (line 2) gives 'epochs' (line 1) again"),
    ("batch-size: 32\nlr: 0.1\nbatch_size: 64\n",
     "'batch_size' (line 3) gives 'batch-size' (line 1) again"),
])
def test_an_option_given_twice_in_yaml_is_refused_naming_both_lines(text, message, tmp_path):
    """YAML keeps the last of two equal keys without a word; dashes and underscores are
    one option."""
    from mpitrain.config import ConfigFileError, load_yaml
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigFileError) as e:
        load_yaml(str(path), set(DEFAULTS))
    assert str(e.value) == f"config file {path}: {message}, and one of them would be " \
                           f"ignored: keep one"


def test_a_config_file_that_is_not_text_is_named(digits):
    from mpitrain.config import ConfigFileError, load_yaml
    path = digits / "digits_val.h5"
    with pytest.raises(ConfigFileError, match=f"config file {path} is not text"):
        load_yaml(str(path), set(DEFAULTS))


@pytest.mark.parametrize("value,ok", [("t.json", True), ("t", True), ("runs/", True),
                                      ("data/digits_train.h5", False), ("t.txt", False)])
def test_trace_takes_a_json_name_or_a_directory(value, ok, capsys):
    """Each rank writes FILE.rankN.json (metrics.trace_path keeps the extension given, so
    --trace data/digits_train.h5 wrote data/digits_train.rank0.h5 among the data)."""
    from mpitrain.cli import build_parser
    if ok:
        assert build_parser().parse_args(["train", "--trace", value]).trace == value
        return
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--trace", value])
    stem = os.path.splitext(value)[0]
    assert f"argument --trace: {value} ends in {os.path.splitext(value)[1]}, and each rank " \
           f"writes its trace as JSON, FILE.rankN.json: name it {stem}.json, or a directory " \
           f"ending in /" in capsys.readouterr().err
