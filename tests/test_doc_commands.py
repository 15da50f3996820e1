"""Every mpitrain command quoted in README.md and docs/*.md parses as written: each line of
a shell block that runs `python -m mpitrain ...`, `./launch.sh ...` (or `sbatch launch.sh`,
or under mpirun / mpiexec / srun) goes through `train`'s and every other command's parser,
so a renamed option or a wrong choice in the docs fails here. Optional parts written as
`[--option VALUE]` are parsed too, and `a|b` takes its first alternative."""
import glob
import os
import re
import shlex

import pytest

from mpitrain.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH_ONLY = {"setup", "test", "test-mpi", "gpu-check", "nothing"}   # launch.sh's own
COMMAND = re.compile(r"(?:python3? -m mpitrain|launch\.sh)\s+(.*)")


def quoted_commands():
    """(file, line, argv) of every mpitrain command in the docs' shell blocks."""
    found = []
    for path in ["README.md"] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                match = COMMAND.search(line)
                if line.startswith("#") or not match or "<" in line or "..." in line:
                    continue
                words = shlex.split(match.group(1).replace("[", " ").replace("]", " "))
                argv = [w.split("|")[0] for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]
                if argv and argv[0] not in LAUNCH_ONLY and not argv[0].startswith("-"):
                    found.append((os.path.relpath(path, ROOT), line, argv))
    return found


COMMANDS = quoted_commands()


def test_the_docs_quote_commands():
    assert len(COMMANDS) > 50 and {argv[0] for _, _, argv in COMMANDS} >= {
        "train", "eval", "predict", "export", "convert", "bench", "plot", "study", "preview"}


@pytest.mark.parametrize("where,line,argv", COMMANDS,
                         ids=[f"{w}:{i}" for i, (w, _, _) in enumerate(COMMANDS)])
def test_a_quoted_command_parses(where, line, argv, capsys):
    try:
        build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `{line}` does not parse: {capsys.readouterr().err.strip()}")
