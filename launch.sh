#!/usr/bin/env bash
# mpitrain launcher.
#
#   ./launch.sh                 set up, then the default job: resnet_small on the bundled
#                               digits with 2 MPI ranks (ends with the validation accuracy)
#   ./launch.sh test            set up, then every test: single-process, those across
#                               emulated hosts, then the MPI tests under mpirun -np 1 to 4
#   ./launch.sh test-mpi        the tests that start MPI jobs (on emulated hosts too), then
#                               the MPI tests (CI runs them again under a second MPI)
#   ./launch.sh test ARGS...    set up, then `pytest ARGS...` in the checkout: a selection,
#                               e.g. tests/test_cli.py -k help (tests/mpi/ need mpirun)
#   ./launch.sh train ARGS...   set up, then `python -m mpitrain train ARGS...` launched with
#                               srun inside a Slurm allocation, else mpirun -np ${NP:-2}
#                               (with --hostfile $HOSTFILE when HOSTFILE is set; on HOSTS
#                               emulated hosts of this machine when HOSTS is set, as root)
#   ./launch.sh COMMAND ARGS... any other mpitrain command alike: eval, convert imagefolder,
#                               bench step and bench comm as MPI jobs, the others (predict,
#                               export, plot, inspect, study, simulate, ...) in one process
#                               (train and the others run in the directory launch.sh was
#                               started from: their relative paths are the caller's; the
#                               default job runs in the checkout)
#   ./launch.sh setup           set up only: the venv, editable install, Cython kernels,
#                               Numba's kernels compiled into their cache
#   ./launch.sh --version       mpitrain's version and checkout, the venv's MPI, Python's
#                               and the libraries' versions (for a bug report)
#   ./launch.sh gpu-check       on a GPU machine without network: prove the GPU path and
#                               write a JSON report (WHEELS=DIR installs from a folder of
#                               wheels first; docs/gpu.md)
#
# The venv is .venv (MPITRAIN_VENV=DIR for another); its MPI is chosen once, when it is
# made: the system's when `mpicc` and `mpiexec` are on PATH, else the `mpich` wheel
# (MPITRAIN_MPI=system|wheel to choose), and recorded in it. Inside a Slurm job nothing
# is installed: run `./launch.sh setup` first, on a login node.
# On a Slurm cluster: `sbatch launch.sh train --epochs 10` from the checkout; the
# #SBATCH lines below are its defaults (override them on the sbatch command line).
#SBATCH --job-name=mpitrain
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --time=00:30:00
#SBATCH --output=mpitrain-%j.out
set -euo pipefail

die() { echo "launch.sh: $*" >&2; exit 2; }
case ${1:-} in -h|--help|help) sed -n '2,/^#SBATCH/{/^#SBATCH/!p}' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac

# The checkout. sbatch runs a copy of this script from slurmd's spool directory, so inside
# a batch job the script's own directory is not the checkout: take the path that was
# submitted (scontrol's Command=), else the directory sbatch was called from.
find_root() {
    local here cmd
    if [[ -n "${MPITRAIN_ROOT:-}" ]]; then
        [[ -f "$MPITRAIN_ROOT/setup.py" ]] || die "MPITRAIN_ROOT=$MPITRAIN_ROOT is not an mpitrain checkout"
        cd "$MPITRAIN_ROOT" && pwd; return
    fi
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    if [[ -f "$here/setup.py" && -f "$here/mpitrain/__init__.py" ]]; then echo "$here"; return; fi
    if [[ -n "${SLURM_JOB_ID:-}" ]] && command -v scontrol >/dev/null; then
        cmd=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -Eo 'Command=[^ ]+' | head -n 1 || true)
        cmd=${cmd#Command=}
        [[ "$cmd" == /* || -z "${SLURM_SUBMIT_DIR:-}" ]] || cmd=$SLURM_SUBMIT_DIR/$cmd
        if [[ "$cmd" == /* && -f "$(dirname "$cmd")/setup.py" ]]; then
            cd "$(dirname "$cmd")" && pwd; return
        fi
    fi
    if [[ -n "${SLURM_SUBMIT_DIR:-}" && -f "$SLURM_SUBMIT_DIR/setup.py" ]]; then
        echo "$SLURM_SUBMIT_DIR"; return
    fi
    die "cannot find the mpitrain checkout (this script runs from ${here}); submit it by its" \
        "path in the checkout (sbatch /path/to/mpitrain/launch.sh ...), or set MPITRAIN_ROOT"
}

CALLER=$PWD                     # where mpitrain's commands run: their paths are the caller's
ROOT=$(find_root)
cd "$ROOT"
VENV=${MPITRAIN_VENV:-$ROOT/.venv}
[[ "$VENV" == /* ]] || VENV=$ROOT/$VENV
PY=$VENV/bin/python
STAMP=$VENV/.mpitrain-installed     # hash of what was installed (setup.py, pyproject.toml,
                                    # the version, kind)
RECORD=$VENV/.mpitrain-mpi          # the venv's MPI: kind=, impl=, mpiexec=, library=
NP_GIVEN=${NP:+1}
NP=${NP:-2}
# a count of ranks: anything else reached mpirun as a bash error, or as 1 rank
[[ $NP =~ ^[0-9]{1,9}$ ]] && (( 10#$NP >= 1 )) || die "NP=$NP: the number of MPI ranks" \
    "must be a whole number of 1 or more (for example NP=4); unset it for 2"
NP=$((10#$NP))                      # 08 is 8, not an octal number's error
IN_JOB=${SLURM_JOB_ID:+1}           # inside a Slurm allocation: never install

# ----- the venv's MPI, decided once -----
MPI_KIND="" MPI_IMPL="" MPI_EXEC="" MPI_LIBRARY=""

read_record() {
    local key value
    [[ -f "$RECORD" ]] || return 1
    while IFS='=' read -r key value; do
        case $key in
            kind) MPI_KIND=$value ;;
            impl) MPI_IMPL=$value ;;
            mpiexec) MPI_EXEC=$value ;;
            library) MPI_LIBRARY=$value ;;
        esac
    done < "$RECORD"
    [[ -n "$MPI_KIND" && -n "$MPI_EXEC" ]]
}

# mpicc and mpiexec of an MPI installed on the system (not the mpich wheel of a venv)
system_mpi() {
    local cc run
    cc=$(command -v mpicc || true)
    run=$(command -v mpiexec || true)
    [[ -n "$cc" && -n "$run" && "$cc" != "$VENV"/* && "$run" != "$VENV"/* ]] || return 1
    echo "$cc $run"
}

# The first line of the MPI library's version string, asked of mpi4py without starting MPI
mpi_library() {
    "$PY" -c 'import mpi4py; mpi4py.rc.initialize = False
from mpi4py import MPI; print(MPI.Get_library_version().replace("\0", "").strip().splitlines()[0])' 2>/dev/null || true
}

# mpich or openmpi (the family srun's --mpi type depends on), from the library mpi4py is
# linked with (MPI_LIBRARY), else from the tools beside mpiexec (mpichversion, ompi_info)
mpi_impl() {   # mpiexec
    local dir
    case $MPI_LIBRARY in
        *"Open MPI"*) echo openmpi; return ;;
        *MPICH*|*"Intel(R) MPI"*|*MVAPICH*) echo mpich; return ;;
    esac
    dir=$(dirname "$1")
    if [[ -x "$dir/ompi_info" ]]; then echo openmpi
    elif [[ -x "$dir/mpichversion" ]]; then echo mpich
    else echo unknown; fi
}

write_record() {
    printf 'kind=%s\nimpl=%s\nmpiexec=%s\nlibrary=%s\n' \
        "$MPI_KIND" "$MPI_IMPL" "$MPI_EXEC" "$MPI_LIBRARY" > "$RECORD.tmp"
    mv "$RECORD.tmp" "$RECORD"
}

# The MPI of a venv made by an older launch.sh, which recorded no kind: the mpich wheel
# leaves its mpiexec in the venv.
legacy_record() {
    local found
    if [[ -x "$VENV/bin/mpiexec" ]]; then
        MPI_KIND=wheel MPI_EXEC=$VENV/bin/mpiexec
    else
        found=$(system_mpi) || return 1
        MPI_KIND=system MPI_EXEC=${found#* }
    fi
    MPI_LIBRARY=$(mpi_library)
    MPI_IMPL=$(mpi_impl "$MPI_EXEC")
}

installed_hash() {   # kind
    cat setup.py pyproject.toml <(grep '^__version__ = ' mpitrain/__init__.py) <(echo "$1") |
        sha256sum | cut -d' ' -f1
}

# The Cython kernels are built and newer than their sources
kernels_built() {
    local suffix src so
    suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))') || return 1
    for src in kernels/*.pyx; do
        so=${src%.pyx}$suffix
        [[ -f "$so" ]] || return 1
        [[ -z "$(find kernels -maxdepth 1 \( -name '*.pyx' -o -name '*.pxi' -o -name '*.pxd' \) \
                  -newer "$so" -print -quit)" ]] || return 1
    done
}

build_kernels() {
    kernels_built && return 0
    [[ -z "$IN_JOB" ]] || die "the Cython kernels in $ROOT/kernels are not built or older than" \
        "their sources; run ./launch.sh setup first (outside a Slurm job, e.g. on a login node)"
    step "building the Cython kernels" "about a minute" "$PY" setup.py build_ext --inplace
}

# One step of the set-up: its name and how long it usually takes, then its output in a
# log, with a line every 30 s saying that it still runs and how much it has written (a
# compile is not a hang), and its time at the end; on failure the log's last lines.
step() {   # what, how long it usually takes, command...
    local what=$1 usual=$2 log pid rc=0 start=$SECONDS next=30
    shift 2
    echo "launch.sh: $what (usually $usual)"
    log=$(mktemp)
    "$@" >"$log" 2>&1 &
    pid=$!
    # a background command ignores Ctrl-C: end it with this script
    trap 'kill "$pid" 2>/dev/null; rm -f "$log"; exit 130' INT
    trap 'kill "$pid" 2>/dev/null; rm -f "$log"; exit 143' TERM
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        if (( SECONDS - start >= next )); then
            echo "launch.sh:   ... $((SECONDS - start)) s, $(wc -l <"$log") lines of output;" \
                 "last: $(tail -n 1 "$log" | cut -c1-100)"
            next=$((next + 30))
        fi
    done
    wait "$pid" || rc=$?
    trap - INT TERM
    if (( rc != 0 )); then
        tail -n 40 "$log" >&2; rm -f "$log"; die "$what failed (exit $rc; its last lines above)"
    fi
    rm -f "$log"
    echo "launch.sh:   done in $((SECONDS - start)) s"
}

# MKL is installed where it will be the team's BLAS (kernels/blas_choice.py):
# MPITRAIN_BLAS=mkl, or MPITRAIN_BLAS unset on Intel's CPUs. Elsewhere NumPy's OpenBLAS is
# the team's BLAS and MKL's 700 MB would lie unused.
cpu_vendor() { grep -m 1 '^vendor_id' /proc/cpuinfo 2>/dev/null | sed 's/.*: *//' || true; }
wants_mkl() {
    local blas=${MPITRAIN_BLAS:-}
    [[ ${blas,,} == mkl || ( -z $blas && $(cpu_vendor) == GenuineIntel ) ]]
}

install() {
    local found cc="" with vendor why
    if [[ $MPI_KIND == system ]]; then
        found=$(system_mpi) || die "MPITRAIN_MPI=system, but no mpicc and mpiexec on PATH"
        cc=${found% *} MPI_EXEC=${found#* }
    else
        MPI_EXEC=$VENV/bin/mpiexec
    fi
    echo "launch.sh: installing mpitrain and its dependencies into $VENV (MPI: $MPI_KIND${cc:+, $cc})"
    [[ -x "$PY" ]] || step "creating the venv" "a few seconds" python3 -m venv "$VENV"
    # the build's requirements as pyproject.toml names them (its one line `requires = [...]`):
    # the install below builds the kernels without isolation, with these
    local build
    read -ra build <<< "$(sed -n 's/^requires = \[\(.*\)\]$/\1/p' pyproject.toml | tr -d '",')"
    step "installing Cython, NumPy, setuptools, wheel" "under a minute" \
        "$PY" -m pip install "${build[@]}"
    if [[ $MPI_KIND == system ]]; then     # mpi4py compiled against the system MPI, into
        # the venv even where one is importable already (a venv that sees other packages)
        echo "launch.sh: mpi4py is compiled against the MPI on PATH; to skip the compile," \
             "stop here (Ctrl-C), remove $VENV and run again with MPITRAIN_MPI=wheel (MPICH" \
             "from the mpich wheel, no compile)"
        MPICC=$cc step "compiling mpi4py against $cc" "5 to 10 minutes on 2 cores" \
            "$PY" -m pip install -v --no-binary=mpi4py --no-cache-dir --ignore-installed mpi4py
    else                                   # MPICH from PyPI, in the venv
        step "installing MPICH (the mpich wheel) and mpi4py" "under a minute" \
            "$PY" -m pip install mpich mpi4py
    fi
    if wants_mkl; then with=test,mkl; else
        with=test vendor=$(cpu_vendor)
        [[ -z ${MPITRAIN_BLAS:-} ]] && why="the CPU is ${vendor:-not Intel}'s" \
            || why="MPITRAIN_BLAS=$MPITRAIN_BLAS"
        echo "launch.sh: MKL is left out ($why: the team's BLAS is NumPy's OpenBLAS);" \
             "\`$VENV/bin/pip install mkl\` adds it, MPITRAIN_BLAS=mkl takes it"
    fi
    step "installing mpitrain and its dependencies (h5py, Numba, SciPy, scikit-learn, ...)" \
        "1 to 3 minutes" "$PY" -m pip install --no-build-isolation -e ".[$with]"
    MPI_LIBRARY=$(mpi_library)
    MPI_IMPL=$(mpi_impl "$MPI_EXEC")
    write_record
    installed_hash "$MPI_KIND" > "$STAMP"
}

# Install when the venv is missing or stale, with the MPI it was made with; inside a
# Slurm job only check. Leaves MPI_KIND, MPI_IMPL, MPI_EXEC set.
setup() {
    local wanted=${MPITRAIN_MPI:-} stale=""
    case $wanted in ""|wheel|system) ;; *) die "MPITRAIN_MPI=$wanted: use wheel or system" ;; esac
    if [[ -x "$PY" ]] && { read_record || legacy_record; }; then
        if [[ -n "$wanted" && "$wanted" != "$MPI_KIND" ]]; then
            die "$VENV was set up with MPI '$MPI_KIND' (recorded in $RECORD), but" \
                "MPITRAIN_MPI=$wanted; remove $VENV or choose another one with MPITRAIN_VENV"
        fi
        [[ "$(cat "$STAMP" 2>/dev/null || true)" == "$(installed_hash "$MPI_KIND")" ]] || stale=1
        [[ -f "$RECORD" || -n "$IN_JOB" ]] || write_record        # a venv of an older launch.sh
    elif [[ -n "$IN_JOB" ]]; then
        die "no set-up venv at $VENV; run ./launch.sh setup first, outside a Slurm job" \
            "(e.g. on a login node): a batch job never installs"
    else
        MPI_KIND=$wanted stale=1
        [[ -n "$MPI_KIND" ]] || { if system_mpi >/dev/null; then MPI_KIND=system; else MPI_KIND=wheel; fi; }
    fi
    if [[ -n "$stale" ]]; then
        [[ -z "$IN_JOB" ]] || die "$VENV is out of date (setup.py or pyproject.toml changed" \
            "since it was installed); run ./launch.sh setup first, outside a Slurm job" \
            "(e.g. on a login node): a batch job never installs"
        install
    fi
    build_kernels
    if [[ ! -x "$MPI_EXEC" ]]; then
        die "the venv's mpiexec $MPI_EXEC (recorded in $RECORD) is gone; remove $VENV and" \
            "run ./launch.sh setup again"
    fi
    if [[ $MPI_IMPL == openmpi && $EUID == 0 ]]; then   # Open MPI refuses root without them
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    fi
    # the checkout's byte code, which an editable install does not write (pip writes that
    # of the packages it installs): without it, and with PYTHONDONTWRITEBYTECODE set, every
    # process compiles the modules it imports; a quiet no-op where it is up to date
    "$PY" -m compileall -q mpitrain nets kernels datasets >/dev/null 2>&1 || true
    # a new venv: Numba compiles the CPU kernels now, not in every rank of the first run
    if [[ -n "$stale" ]]; then
        step "compiling the CPU kernels (an epoch of the digits in fp32 and in fp16)" \
            "under a minute" "$PY" -m mpitrain.tools.warm
    fi
}

# ----- launching -----
# "VAR=n ..." assignments for `env`: each of $1 ranks on this host gets its share of the
# cores for its OpenMP team, which also runs its GEMMs with OpenBLAS on one thread per call
# (kernels/gemm.py), unless the user chose thread counts already.
thread_env() {
    [[ -z "${OMP_NUM_THREADS:-}${OPENBLAS_NUM_THREADS:-}${NUMBA_NUM_THREADS:-}" ]] || return 0
    local n=$(( $(nproc) / $1 ))
    (( n >= 1 )) || n=1
    echo "OMP_NUM_THREADS=$n OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=$n"
}

# HOSTS=N: the job on N hosts emulated on this machine, nodeA, nodeB, ..., with NP / N
# ranks each: tests/emulated_host.sh stands in for ssh and starts each host's processes
# in a UTS namespace of that name, so MPI finds N nodes. Refuses what cannot run.
AGENT=$ROOT/tests/emulated_host.sh
check_emulated_hosts() {   # hosts, ranks
    [[ $1 =~ ^[1-9][0-9]*$ ]] && (( $1 <= 26 )) \
        || die "HOSTS=$1: give the number of hosts to emulate on this machine (1 to 26)"
    (( $2 % $1 == 0 )) || die "HOSTS=$1 does not divide NP=$2: every emulated host runs" \
        "NP / HOSTS ranks; choose NP as a multiple of $1"
    [[ -z "${HOSTFILE:-}" ]] || die "HOSTS and HOSTFILE exclude each other: HOSTS emulates" \
        "hosts on this machine, HOSTFILE names real ones; unset one of them"
    [[ "$("$AGENT" probe-host hostname 2>&1)" == probe-host ]] || die "HOSTS=$1: this" \
        "machine cannot give a process a host name of its own ($AGENT: unshare --uts" \
        "needs root); run as root, or unset HOSTS"
}

# a host file's line with a count of slots, as the venv's MPI reads it
slots_format() {
    if [[ $MPI_IMPL == openmpi ]]; then echo '"host slots=N"'; else echo '"host:N"'; fi
}

# mpiexec and its options for $1 ranks, on this host or on $2 emulated hosts (prints one
# word per line). Ranks that outnumber this machine's cores yield the core while they
# wait for a message, rather than spin on it: MPICH's with ENABLE_HEAVY_YIELD (they sleep
# in their wait loop), Open MPI's with mpi_yield_when_idle (which --oversubscribe sets).
mpiexec_words() {   # ranks, [hosts]
    local names=({A..Z}) list="" i
    echo "$MPI_EXEC"
    # Open MPI: no help messages after a rank's exit, so that a refused job's last line
    # is its own reason and fix
    [[ $MPI_IMPL != openmpi ]] || echo --quiet
    if [[ $MPI_IMPL != openmpi && -z "${HOSTFILE:-}" ]] && (( $1 > $(nproc) )); then
        printf '%s\n' -genv MPIR_CVAR_ENABLE_HEAVY_YIELD 1
    fi
    if [[ -n "${2:-}" ]]; then
        for ((i = 0; i < $2; i++)); do list+=${list:+,}node${names[i]}:$(( $1 / $2 )); done
        if [[ $MPI_IMPL == openmpi ]]; then
            # each daemon reports to mpirun directly; ranks that outnumber the cores are
            # told to yield (each host's slots hold its ranks: Open MPI sees no
            # oversubscription)
            printf '%s\n' --bind-to none --host "$list" --mca plm_rsh_agent "$AGENT" \
                --mca routed direct
            (( $1 <= $(nproc) )) || printf '%s\n' --mca mpi_yield_when_idle 1
        else
            printf '%s\n' -hosts "$list" -bootstrap ssh -bootstrap-exec "$AGENT"
        fi
    elif [[ $MPI_IMPL == openmpi ]]; then
        # no binding (each rank's threads share the cores, as under MPICH), and more ranks
        # than cores allowed on one host (a hostfile's slots say it otherwise)
        printf '%s\n' --bind-to none
        [[ -n "${HOSTFILE:-}" ]] || (( $1 <= $(nproc) )) || echo --oversubscribe
    fi
    [[ -z "${HOSTFILE:-}" ]] || printf '%s\n' --hostfile "$HOSTFILE"
    printf '%s\n' -np "$1"
}

# srun's --mpi type for the venv's MPI: PMI-2 for MPICH, PMIx for Open MPI, when srun
# offers it; SRUN_FLAGS=--mpi=TYPE overrides it.
srun_mpi() {
    local want list alt
    [[ " ${SRUN_FLAGS:-} " != *" --mpi"* ]] || return 0
    case $MPI_IMPL in mpich) want=pmi2 alt=pmix ;; openmpi) want=pmix alt=pmi2 ;; *) want="" ;; esac
    if [[ -z "$want" ]]; then
        echo "launch.sh: unknown MPI in $VENV ($MPI_LIBRARY); srun starts it with its default" \
             "--mpi type (set SRUN_FLAGS=--mpi=TYPE if the ranks do not find each other)" >&2
        return 0
    fi
    list=$(srun --mpi=list 2>&1 | tr -s ' \t' '\n' || true)
    if grep -qx "$want" <<<"$list"; then echo "--mpi=$want"; return 0; fi
    if grep -qx "$alt" <<<"$list"; then
        echo "launch.sh: srun offers no --mpi=$want (the type $MPI_IMPL needs); trying" \
             "--mpi=$alt (srun --mpi=list: $(grep -Ex '[a-z_0-9]+' <<<"$list" | tr '\n' ' '))" >&2
        echo "--mpi=$alt"; return 0
    fi
    echo "launch.sh: srun offers neither --mpi=$want nor --mpi=$alt; starting with srun's" \
         "default type: if it gives the ranks no PMI, each starts alone and mpitrain refuses" \
         "to run (set SRUN_FLAGS=--mpi=TYPE)" >&2
}

# Run the local launcher in the background of a job-controlled shell (its own process
# group), so that a Ctrl-C reaches this shell alone, which passes each one on once:
# the first lets the ranks checkpoint and exit (130), a second ends them at once.
# MPICH's mpiexec forwards SIGINT and SIGTERM to the ranks (a second SIGINT: it kills
# them, and reports 0 or 255; this returns 130 then, as for any interrupted command).
# Open MPI's mpirun forwards neither (it kills the job, and reports 1): its ranks on this
# host, its children, get them straight; the first rank to see one stops every rank.
# SIGUSR1 both forward.
# The launcher gets SIGUSR1 from the kernel if this shell dies (kill -9): both MPIs pass it
# to the ranks, wherever they run, which checkpoint and end (Open MPI's mpirun would kill
# them a second after a SIGTERM); the ranks' own watch of this shell
# (MPITRAIN_LAUNCHER_PID) sees only ranks on this host.
run_forwarding() {   # command...
    local pid rc ints=0 sent=""
    set -m
    "${ON_OUR_DEATH[@]}" "$@" </dev/null &
    pid=$!
    set +m
    trap 'ints=$((ints + 1)); sent=INT; pass_on INT "$pid" "$ints"' INT
    trap 'sent=TERM; pass_on TERM "$pid" 1' TERM
    trap 'sent=HUP; pass_on TERM "$pid" 1' HUP
    trap 'sent=USR1; kill -USR1 "$pid" 2>/dev/null || true' USR1
    while :; do
        rc=0
        wait "$pid" || rc=$?
        kill -0 "$pid" 2>/dev/null || break       # a trapped signal interrupted the wait
    done
    trap - INT TERM HUP USR1
    if (( ints >= 2 )) && (( rc == 0 || rc == 255 )); then rc=130; fi
    # Open MPI's mpirun, --quiet, says nothing of a rank that a signal killed (kill -9, the
    # kernel's out-of-memory killer, a crash); 129, 130 and 143 are mpitrain's own ends
    # (its launcher gone, a SIGINT or SIGTERM it stopped on, with a checkpoint)
    if [[ $MPI_IMPL == openmpi && -z $sent ]] && (( rc > 130 && rc < 160 && rc != 143 )); then
        echo "launch.sh: a rank was killed by SIG$(kill -l $((rc - 128))) (mpirun's status" \
            "$rc): the job ended there; with SIGKILL, look for the out-of-memory killer" \
            "in the system's log (dmesg)" >&2
    fi
    return "$rc"
}
ON_OUR_DEATH=()
if setpriv --help 2>/dev/null | grep -q -- --pdeathsig; then
    ON_OUR_DEATH=(setpriv --pdeathsig USR1)
fi

pass_on() {   # signal, launcher pid, how many of it so far
    local ranks
    if [[ $MPI_IMPL == openmpi ]] && (( $3 <= 2 )); then
        ranks=$(ranks_below "$2")
        if [[ -n "$ranks" ]]; then
            # shellcheck disable=SC2086
            kill -"$1" $ranks 2>/dev/null || true
            return 0
        fi
    fi
    kill -"$1" "$2" 2>/dev/null || true           # a third Ctrl-C: mpirun kills the job
}

# The pids of mpitrain's processes among the descendants of $1: mpirun's ranks, its
# children on this host, or on emulated hosts its daemon's, under the agent's shell (which
# would absorb a SIGINT)
ranks_below() {   # pid
    ps -e -o pid=,ppid=,args= 2>/dev/null | awk -v root="$1" '
        { pid[NR] = $1; ppid[NR] = $2; $1 = $2 = ""; args[NR] = $0 }
        END {
            below[root] = 1
            do {
                more = 0
                for (i = 1; i <= NR; i++)
                    if ((ppid[i] in below) && !(pid[i] in below)) { below[pid[i]] = 1; more = 1 }
            } while (more)
            for (i = 1; i <= NR; i++)
                if (pid[i] != root && (pid[i] in below) && args[i] ~ / -m mpitrain /) print pid[i]
        }' || true
}

# `python -m mpitrain ARGS...` as an MPI job: srun inside a Slurm allocation, else the
# venv's mpiexec with NP ranks
run_mpi() {
    if [[ -n "${SLURM_JOB_ID:-}" ]]; then
        [[ -z "${HOSTS:-}" ]] || die "HOSTS=$HOSTS emulates hosts on one machine; inside a" \
            "Slurm allocation srun starts the ranks on its nodes: unset HOSTS"
        [[ -z "${HOSTFILE:-}" ]] || die "HOSTFILE=$HOSTFILE names hosts for mpirun; inside a" \
            "Slurm allocation srun starts the ranks on its nodes: unset HOSTFILE"
        [[ -z $NP_GIVEN ]] || [[ $NP == "${SLURM_NTASKS:-$NP}" ]] || echo "launch.sh: NP=$NP" \
            "is not used inside a Slurm allocation: srun starts its ${SLURM_NTASKS} tasks" >&2
        # exec: srun takes this shell's place, so a signal to the batch shell
        # (--signal=B:USR1@N) reaches srun, which forwards it to every task. Threads:
        # the program shares each host's cores among its ranks itself.
        local mpi
        mpi=$(srun_mpi)
        # shellcheck disable=SC2086
        exec srun --kill-on-bad-exit=1 $mpi ${SRUN_FLAGS:-} "$PY" -m mpitrain "$@"
    fi
    local words
    [[ -z "${HOSTS:-}" ]] || check_emulated_hosts "$HOSTS" "$NP"
    [[ -z "${HOSTFILE:-}" || -f "$HOSTFILE" ]] || die "HOSTFILE=$HOSTFILE: no such file" \
        "(mpirun --hostfile reads one host a line, \"host\" or $(slots_format)); unset" \
        "HOSTFILE to run on this machine"
    mapfile -t words < <(mpiexec_words "$NP" "${HOSTS:-}")
    # the ranks end the job when this shell is gone (kill -9 of it reaches no rank: the
    # launcher runs in a process group of its own)
    export MPITRAIN_LAUNCHER_PID=$$ MPITRAIN_LAUNCHER_HOST=$HOSTNAME
    # shellcheck disable=SC2046
    # across real hosts the ranks share each host's cores among themselves (the program
    # counts them), as under srun; this host's count would be wrong there
    run_forwarding env $([[ -n "${HOSTFILE:-}" ]] || thread_env "$NP") "${words[@]}" \
        "$PY" -m mpitrain "$@"
}

# python -m mpitrain's commands. Those that are MPI jobs (a command and its first word)
# run under run_mpi; the others in one process, as their --help says (study and simulate
# --calibrate start MPI jobs of their own, with the venv's mpiexec).
COMMANDS=(train eval predict export plot inspect preview convert bench study simulate check-gpu)
is_mpi_job() {   # command, its arguments...
    case "$1 ${2:-}" in
        "train "*|"eval "*|"convert imagefolder"|"bench step"|"bench comm") return 0 ;;
    esac
    return 1
}

run_command() {   # command, its arguments...
    if is_mpi_job "$@"; then
        run_mpi "$@"
    else
        "$PY" -m mpitrain "$@"
    fi
}

# One test phase under `timeout` (a hang cannot stall CI); records a summary line and
# adds the phase's pytest counts to the totals. Uses run_tests' `summary`, `failed`, `count`.
run_phase() {   # name, time limit in seconds, command...
    local name=$1 limit=$2 start=$SECONDS rc=0 log line word n
    shift 2
    echo "=== $name"
    log=$(mktemp)
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$log" || rc=$?
    line=$(grep -E '^=*ImportError|[0-9]+ (passed|failed|skipped|errors?)\b' "$log" | tail -n 1 || true)
    rm -f "$log"
    for word in passed failed skipped error; do
        n=$(grep -Eo "[0-9]+ $word" <<<"$line" | cut -d' ' -f1 || true)
        count[$word]=$(( ${count[$word]} + ${n:-0} ))
    done
    if (( rc == 0 )); then
        summary+=("PASS  $name  ($((SECONDS - start)) s)")
    else
        local why="exit $rc"
        (( rc == 124 )) && why="timed out after $limit s"
        (( rc == 5 )) && why="no tests collected"
        [[ -n "$line" ]] || count[error]=$(( ${count[error]} + 1 ))   # died before reporting
        summary+=("FAIL  $name  ($why, $((SECONDS - start)) s)")
        failed=1
    fi
}

# pytest-xdist's options for the single-process phase: a test process per core, up to 4
# (most of these tests keep one core busy, and their MPI jobs are small); each file's tests
# stay in one process, in order, so a module's fixture (a Slurm cluster, a converted data
# set) is made once. None where there is one core or no pytest-xdist.
test_processes() {
    local n
    n=$(nproc)
    (( n > 4 )) && n=4
    (( n > 1 )) && "$PY" -c "import xdist" 2>/dev/null && echo "-n $n --dist loadfile"
    return 0
}

# $1: all (every test) or mpi (those that start MPI jobs, then the MPI tests)
run_tests() {
    local summary=() failed=0 n words select=() what="single-process tests" color=no
    local -A count=([passed]=0 [failed]=0 [skipped]=0 [error]=0)
    echo "launch.sh: MPI $MPI_KIND ($MPI_IMPL: $MPI_LIBRARY), $MPI_EXEC"
    if [[ $1 == mpi ]]; then select=(-m "launches and not one_mpi") what="tests that start MPI jobs"; fi
    [[ ! -t 1 ]] || color=yes        # Open MPI gives its ranks a terminal even for a log
    # shellcheck disable=SC2046
    run_phase "$what" 1800 env $(thread_env 1) "$PY" -m pytest tests --ignore=tests/mpi \
        --ignore=tests/test_nodes.py -q $(test_processes) "${select[@]}"
    # jobs on emulated hosts: the MPI tests and training across node boundaries
    # shellcheck disable=SC2046
    run_phase "tests across emulated hosts (tests/test_nodes.py)" 900 env $(thread_env 1) \
        "$PY" -m pytest tests/test_nodes.py -q "${select[@]}"
    # 3 ranks: a world that is not a power of two, and uneven nodes with --ranks-per-node 2
    for n in 1 2 3 4; do
        mapfile -t words < <(mpiexec_words "$n")
        # shellcheck disable=SC2046
        run_phase "MPI tests, $n rank(s)" 300 env $(thread_env "$n") \
            "${words[@]}" "$PY" -m mpi4py -m pytest tests/mpi -q -p no:cacheprovider --color=$color
    done
    echo "=== summary ($MPI_IMPL)"
    printf '%s\n' "${summary[@]}"
    echo "total: ${count[passed]} passed, $(( count[failed] + count[error] )) failed, ${count[skipped]} skipped"
    return "$failed"
}

# The GPU check sees the machine's own CuPy, NCCL and cuDNN wheels: a .venv it makes
# includes the system's site-packages, and it installs nothing from the network.
gpu_check() {
    if [[ ! -x "$PY" ]]; then
        python3 -m venv --system-site-packages "$VENV"
        # A python3 that is itself a venv's (as a GPU image's often is) gives the new venv
        # the base interpreter's site-packages, not its own: name its own in a .pth file.
        python3 -c 'import site, sys; sys.prefix != sys.base_prefix and print("\n".join(site.getsitepackages()))' \
            > "$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/python3-site.pth"
    fi
    local status=0
    "$PY" -m mpitrain.tools.check_gpu ${WHEELS:+--wheels "$WHEELS"} "$@" || status=$?
    # Once the check has installed mpitrain and an MPI, the venv is set up: record it, so
    # that `./launch.sh train` on this machine without network uses it as it is.
    if [[ ! -f "$STAMP" ]] && "$PY" -c 'import mpitrain.kernels' 2>/dev/null && legacy_record; then
        write_record
        installed_hash "$MPI_KIND" > "$STAMP"
    fi
    return "$status"
}

command=${1:-default}
case $command in
    setup) IN_JOB=""; setup ;;   # asked for: installs even inside an allocation
    default)
        setup
        # its data/ and runs/ are the checkout's, whatever the caller's directory
        [[ "$CALLER" -ef "$ROOT" ]] || echo "launch.sh: the main job runs in the checkout," \
            "$ROOT: the paths it prints (data/, runs/) are there"
        run_mpi train ;;
    test)
        setup
        if (($# > 1)); then shift; exec "$PY" -m pytest "$@"; fi
        run_tests all ;;
    test-mpi) setup; run_tests mpi ;;
    gpu-check) shift; gpu_check "$@" ;;
    --version)
        setup
        echo "launch.sh: venv $VENV, MPI $MPI_KIND ($MPI_IMPL: $MPI_LIBRARY), $MPI_EXEC"
        "$PY" -m mpitrain --version ;;
    *)
        [[ " ${COMMANDS[*]} " == *" $command "* ]] || die "unknown command '$command' (use:" \
            "setup, test, test-mpi, gpu-check, --version, no command for the default job, or" \
            "one of mpitrain's:" \
            "${COMMANDS[*]})"
        setup; cd "$CALLER"; run_command "$@" ;;
esac
