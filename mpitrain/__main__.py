"""`python -m mpitrain` and the installed `mpitrain` script: the command line, through
mpitrain.cli.run, which ends the whole job when a rank fails."""
import sys


def main():
    if sys.argv[1:2] == ["train"]:  # a stop signal from here on is kept (control.record_early):
        from mpitrain.control import record_early   # the command line's imports take a
        record_early()                              # second, and Slurm's --signal may come in it
    from mpitrain.cli import run
    run()


if __name__ == "__main__":
    main()
