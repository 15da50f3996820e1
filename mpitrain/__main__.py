"""`python -m mpitrain` and the installed `mpitrain` script: the command line, through
mpitrain.cli.run, which ends the whole job when a rank fails."""
import sys


def main():
    if sys.argv[1:2] == ["train"]:  # a stop signal from here on is kept (control.record_early):
        from mpitrain.control import record_early   # the run's imports take a second or
        record_early()                              # two, and Slurm's --signal may come in them
    from mpitrain.cli import run
    run()


if __name__ == "__main__":
    main()
