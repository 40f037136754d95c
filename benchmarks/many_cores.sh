#!/usr/bin/env bash
# The many-core figures of docs/performance.md: tcoll beside MPICH (and gloo) at 2 to 16 ranks on one host,
# the kernel copy at every page offset, and the one-step limits by rank count. Run from the repository root
# on a machine with at least 16 cores, with tcoll importable (pip install -e ".[compare]" torch) or from
# a source tree built in place (python -c "from setuptools import setup; setup()" build_ext --inplace;
# PYTHONPATH=src).
#   benchmarks/many_cores.sh OUT [part]     part: all (default), copy, thresholds, bench
set -uo pipefail
out=${1:-many-cores}
part=${2:-all}
ranks=${RANKS:-2 4 8 16}
mkdir -p "$out"
py=${PYTHON:-python3}

if [[ $part == all || $part == copy ]]; then
    $py benchmarks/copy_offsets.py --sizes 64K,1M,16M,64M --markdown > "$out/copy_offsets.md" 2>&1
fi
if [[ $part == all || $part == thresholds ]]; then
    $py benchmarks/shm_thresholds.py --ranks "${ranks// /,}" --minbytes 1024 --maxbytes 1048576 --markdown \
        > "$out/thresholds.md" 2>&1
fi
if [[ $part == all || $part == bench ]]; then
    for n in $ranks; do
        compare=mpi
        [[ -n ${GLOO:-} ]] && compare=mpi,gloo
        $py -m tcoll bench all_reduce -n "$n" -b 8 -e 64M -f 8 --compare "$compare" --timeout "${SWEEP_TIMEOUT:-90}" \
            --repeats 3 --markdown --json "$out/all_reduce-$n.json" > "$out/all_reduce-$n.md" 2>&1
    done
fi
