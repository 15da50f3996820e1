#!/usr/bin/env bash
# mpitrain launcher.
#
#   ./launch.sh                 set up, then the default job: resnet_small on the bundled
#                               digits with 2 MPI ranks (ends with the validation accuracy)
#   ./launch.sh test            set up, then every test: single-process, then the MPI tests
#                               under mpirun -np 1, 2, 3 and 4
#   ./launch.sh train ARGS...   set up, then `python -m mpitrain train ARGS...` launched with
#                               srun inside a Slurm allocation, else mpirun -np ${NP:-2}
#                               (with --hostfile $HOSTFILE when HOSTFILE is set)
#   ./launch.sh setup           set up only: .venv, editable install, Cython kernels
#
# On a Slurm cluster: `sbatch launch.sh train --epochs 10`; the #SBATCH lines below
# are its defaults (override them on the sbatch command line).
#SBATCH --job-name=mpitrain
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --time=00:30:00
#SBATCH --output=mpitrain-%j.out
set -euo pipefail

# sbatch runs a copy of this script from a spool directory: find the checkout
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ -f "$here/setup.py" ]]; then ROOT=$here; else ROOT=${SLURM_SUBMIT_DIR:?cannot find the mpitrain checkout}; fi
cd "$ROOT"
VENV=$ROOT/.venv
PY=$VENV/bin/python
NP=${NP:-2}

# An MPI installed on the system (not the mpich wheel inside our own venv).
system_mpi() {
    local cc run
    cc=$(command -v mpicc || true)
    run=$(command -v mpiexec || true)
    [[ -n "$cc" && -n "$run" && "$cc" != "$VENV"/* && "$run" != "$VENV"/* ]]
}

setup() {
    [[ -x "$PY" ]] || python3 -m venv "$VENV"
    local mpi=wheel
    system_mpi && mpi=system
    local stamp=$VENV/.mpitrain-installed
    local hash
    hash=$(cat setup.py pyproject.toml <(echo "$mpi") | sha256sum | cut -d' ' -f1)
    if [[ "$(cat "$stamp" 2>/dev/null || true)" != "$hash" ]]; then
        echo "launch.sh: installing mpitrain and its dependencies into $VENV (MPI: $mpi)"
        "$PY" -m pip install -q cython numpy setuptools wheel
        if [[ $mpi == system ]]; then
            "$PY" -m pip install -q --no-binary=mpi4py mpi4py     # built against the system MPI
        else
            "$PY" -m pip install -q mpich mpi4py                  # MPICH from PyPI, in the venv
        fi
        "$PY" -m pip install -q --no-build-isolation -e ".[test]"
        echo "$hash" > "$stamp"
    fi
    "$PY" setup.py build_ext --inplace -q     # cheap when the kernels are up to date
}

mpirun_cmd() {
    if [[ -x "$VENV/bin/mpiexec" ]]; then echo "$VENV/bin/mpiexec"; else echo mpiexec; fi
}

# "VAR=n ..." assignments for `env`: each of $1 ranks on this node gets its share of the
# cores, unless the user chose thread counts already.
thread_env() {
    [[ -z "${OMP_NUM_THREADS:-}${OPENBLAS_NUM_THREADS:-}${NUMBA_NUM_THREADS:-}" ]] || return 0
    local n=$(( $(nproc) / $1 ))
    (( n >= 1 )) || n=1
    echo "OMP_NUM_THREADS=$n OPENBLAS_NUM_THREADS=$n NUMBA_NUM_THREADS=$n"
}

run_train() {
    if [[ -n "${SLURM_JOB_ID:-}" ]]; then
        # shellcheck disable=SC2046,SC2086
        env $(thread_env "${SLURM_NTASKS_PER_NODE:-1}") srun ${SRUN_FLAGS:-} "$PY" -m mpitrain train "$@"
    else
        # shellcheck disable=SC2046
        # HOSTFILE: one host per line, optionally host:slots (MPICH and Open MPI read it alike)
        env $(thread_env "$NP") "$(mpirun_cmd)" ${HOSTFILE:+--hostfile "$HOSTFILE"} \
            -np "$NP" "$PY" -m mpitrain train "$@"
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

run_tests() {
    local summary=() failed=0 mpirun n
    local -A count=([passed]=0 [failed]=0 [skipped]=0 [error]=0)
    mpirun=$(mpirun_cmd)
    # shellcheck disable=SC2046
    run_phase "single-process tests" 900 env $(thread_env 1) "$PY" -m pytest tests --ignore=tests/mpi -q
    # 3 ranks: a world that is not a power of two, and uneven nodes with --ranks-per-node 2
    for n in 1 2 3 4; do
        # shellcheck disable=SC2046
        run_phase "MPI tests, $n rank(s)" 300 env $(thread_env "$n") \
            "$mpirun" -np "$n" "$PY" -m mpi4py -m pytest tests/mpi -q -p no:cacheprovider
    done
    echo "=== summary"
    printf '%s\n' "${summary[@]}"
    echo "total: ${count[passed]} passed, $(( count[failed] + count[error] )) failed, ${count[skipped]} skipped"
    return "$failed"
}

command=${1:-default}
case $command in
    setup) setup ;;
    default) setup; run_train ;;
    train) shift; setup; run_train "$@" ;;
    test) setup; run_tests ;;
    -h|--help|help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' ;;
    *) echo "launch.sh: unknown command '$command' (use: setup, train ARGS..., test, or nothing)" >&2; exit 2 ;;
esac
