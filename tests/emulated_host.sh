#!/bin/sh
# A stand-in for ssh that makes one machine look like several hosts to MPI: it runs the
# command here, in a new UTS namespace named HOST (unshare --uts, which needs root), so
# the processes a launcher starts through it for HOST see that host name, and MPI takes
# every name for a host of its own (COMM_TYPE_SHARED, its shared-memory transport),
# while they all share this machine's cores, memory, files and network.
#
# Called as a launcher calls ssh: [options] HOST COMMAND...; as with ssh, the command
# words are joined into one shell command line (Open MPI passes one, MPICH several).
#   MPICH:    mpiexec -hosts nodeA:2,nodeB:2 -bootstrap ssh -bootstrap-exec THIS ...
#   Open MPI: mpirun --host nodeA:2,nodeB:2 --mca plm_rsh_agent THIS --mca routed direct ...
while [ $# -gt 0 ]; do
    case $1 in -*) shift ;; *) break ;; esac      # ssh's options (MPICH passes -x)
done
if [ $# -lt 2 ]; then
    echo "emulated_host.sh: usage: emulated_host.sh [ssh options] HOST COMMAND..." >&2
    exit 255                                      # ssh's status for its own errors
fi
host=$1
shift
exec unshare --uts sh -c 'hostname "$1" || exit 255; exec sh -c "$2"' emulated_host.sh "$host" "$*"
