#!/usr/bin/env bash
# The many-core figures of docs/performance.md: tcoll beside MPICH and gloo at 2 to 16 ranks on one host,
# the kernel copy at every page offset, and the one-step limits by rank count, all appended to one
# Markdown file as they are measured (OUT/many_cores.md). Run from the repository root on a machine with
# at least 16 cores, with tcoll importable (pip install -e ".[compare]" torch, or a source tree built in
# place: python -c "from setuptools import setup; setup()" build_ext --inplace; PYTHONPATH=src).
#   benchmarks/many_cores.sh OUT [part...]     parts: copy thresholds bench spin gloo (default: all, in order)
# Environment: RANKS ("2 4 8 16"), MPIEXEC (the mpiexec of mpi4py's MPI library; the libmpi beside it becomes
# MPI4PY_LIBMPI unless that is set), SWEEP_TIMEOUT (90 s),
# GLOO_MAX (largest gloo size, 64M), MEASURED_LIMITS (1: bench with the one-step limits just measured).
set -uo pipefail
out=${1:-many-cores}
shift || true
parts=${*:-copy thresholds bench spin gloo}
ranks=${RANKS:-2 4 8 16}
py=${PYTHON:-python3}
mkdir -p "$out"
log="$out/many_cores.md"
mpiexec_arg=()
[[ -n ${MPIEXEC:-} ]] && mpiexec_arg=(--mpiexec "$MPIEXEC")
# mpi4py's wheel loads the first libmpi the loader finds (a system Open MPI, say), which then sees each
# process of MPICH's mpiexec as a world of one: point it at the library beside that mpiexec.
beside=$(ls "$(dirname "${MPIEXEC:-/nonexistent}")"/../lib/libmpi.so.[0-9]* 2>/dev/null | head -n 1)
[[ -z ${MPI4PY_LIBMPI:-} && -n $beside ]] && export MPI4PY_LIBMPI=$beside MPI4PY_MPIABI=mpich
# `pip install --target DIR mpich-*.whl` puts mpiexec in DIR/bin but leaves out the wheel's lib/: unzip it
# there first (unzip -q mpich-*.whl 'mpich-*.data/data/lib/*' -d /tmp/w && cp -a /tmp/w/*/data/lib DIR/).
[[ -n ${MPIEXEC:-} && -z ${MPI4PY_LIBMPI:-} ]] && echo "many_cores.sh: no libmpi beside $MPIEXEC and no" \
    "MPI4PY_LIBMPI: mpi4py may load another MPI, and the MPI columns will be refused" >&2
section() { printf '\n## %s\n\n' "$*" >> "$log"; }

for part in $parts; do
    case $part in
    copy)
        section "Copy speed by page offset"
        $py benchmarks/copy_offsets.py --sizes 64K,1M,16M,64M --markdown >> "$log" 2>&1 ;;
    thresholds)
        section "One step against three, by rank count"
        $py benchmarks/shm_thresholds.py --ranks "${ranks// /,}" --minbytes 1024 --maxbytes 1048576 --markdown \
            >> "$log" 2>&1 ;;
    bench)  # with MEASURED_LIMITS=1, each rank count's one-step limit is the one the thresholds part found
        for n in $ranks; do
            limit=$(sed -n "s/^$n ranks: .*measured best up to \([0-9]*\) KiB$/\1/p" "$log" | tail -n 1)
            one_step=()
            [[ -n ${MEASURED_LIMITS:-} && -n $limit ]] && one_step=(env "TCOLL_SHM_ONE_STEP=${limit}K")
            section "all_reduce, $n ranks, tcoll beside MPICH ${one_step[*]:+(${one_step[1]})}"
            "${one_step[@]}" $py -m tcoll bench all_reduce -n "$n" -b 8 -e 64M -f 8 --compare mpi "${mpiexec_arg[@]}" \
                --timeout "${SWEEP_TIMEOUT:-90}" --repeats 3 --markdown >> "$log" 2>&1
        done ;;
    spin)  # the waiting policy's ceiling at the largest rank count: the default against 1 ms
        n=${ranks##* }
        for spin in default 1000; do
            section "all_reduce, $n ranks, TCOLL_SPIN_US=$spin"
            if [[ $spin == default ]]; then env -u TCOLL_SPIN_US $py -m tcoll bench all_reduce -n "$n" -b 8 -e 2M -f 8 \
                --no-copy --repeats 3 --markdown >> "$log" 2>&1
            else TCOLL_SPIN_US=$spin $py -m tcoll bench all_reduce -n "$n" -b 8 -e 2M -f 8 --no-copy --repeats 3 \
                --markdown >> "$log" 2>&1
            fi
        done ;;
    gloo)
        for n in $ranks; do
            section "all_reduce, $n ranks, tcoll beside gloo"
            $py -m tcoll bench all_reduce -n "$n" -b 8 -e "${GLOO_MAX:-64M}" -f 8 --compare gloo --no-copy \
                --timeout "${SWEEP_TIMEOUT:-90}" --repeats 3 --markdown >> "$log" 2>&1
        done ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
    esac
done
