"""`python -m mpitrain`: the command line, through the same wrapper as the installed
`mpitrain` script (mpitrain.cli.run), which ends the whole job when a rank fails."""
import sys

if sys.argv[1:2] == ["train"]:      # a stop signal from here on is kept (control.record_early):
    from mpitrain.control import record_early   # the command line's imports take a second,
    record_early()                              # and Slurm's --signal may come in it

from mpitrain.cli import run

run()
