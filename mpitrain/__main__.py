"""`python -m mpitrain`: the command line, through the same wrapper as the installed
`mpitrain` script (mpitrain.cli.run), which ends the whole job when a rank fails."""
from mpitrain.cli import run

run()
