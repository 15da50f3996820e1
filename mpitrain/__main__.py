"""`python -m mpitrain`: run the CLI; an uncaught exception on any rank ends the whole job.

Without the Abort, one rank dying inside a training step leaves the others
waiting forever in their next collective.
"""
import sys
import traceback

from mpitrain.cli import main

try:
    main()
except (SystemExit, KeyboardInterrupt):
    raise
except BaseException:
    MPI = getattr(sys.modules.get("mpi4py"), "MPI", None)
    world = MPI.COMM_WORLD if MPI is not None and MPI.Is_initialized() else None
    where = f"rank {world.rank} of {world.size}" if world is not None else "mpitrain"
    sys.stderr.write(f"{where}: uncaught exception, ending the job\n{traceback.format_exc()}")
    sys.stderr.flush()
    if world is not None and world.size > 1:
        world.Abort(1)
    sys.exit(1)
