#!/usr/bin/env bash
# The one-host figures of docs/performance.md: tcoll beside gloo and MPICH, all ranks on this machine.
# Needs: pip install -e ".[compare,plot]" torch==2.13.0   (MPICH from PyPI; gloo from torch)
# Each command prints a Markdown table; --json keeps every sample. Takes 10-20 minutes on 2 cores.
set -euo pipefail
out=${1:-bench-results}
mkdir -p "$out"
common=(--compare gloo,mpi --check --repeats 3 --markdown)

# 2 ranks: all_reduce over the whole range, ordinary arrays and comm.empty buffers
tcoll bench all_reduce -n 2 -b 8 -e 64M -f 8 --buffers both "${common[@]}" \
    --json "$out/all_reduce-2.json" --plot "$out/all_reduce-2.png"
# 2 ranks: the other bandwidth targets at 64 MiB
for case in all_gather reduce_scatter broadcast; do
    tcoll bench "$case" -n 2 -b 1M -e 64M -f 64 --buffers both "${common[@]}" --json "$out/$case-2.json"
done
# 4 and 8 ranks on 2 cores, quiet and with one busy process loading the machine
for n in 4 8; do
    tcoll bench all_reduce -n "$n" -b 8 -e 64M -f 8 "${common[@]}" --json "$out/all_reduce-$n.json" \
        --plot "$out/all_reduce-$n.png"
    tcoll bench all_reduce -n "$n" -b 8 -e 64K -f 8192 --load 1 "${common[@]}" --json "$out/all_reduce-$n-load.json"
done
# every all_reduce algorithm, and every collective, 4 ranks (tcoll alone)
tcoll bench all_reduce -n 4 -b 8 -e 16M -f 16 --algorithm all --repeats 3 --markdown --json "$out/algorithms-4.json"
tcoll bench all -n 4 -b 8 -e 16M -f 64 --check --repeats 3 --markdown --json "$out/collectives-4.json"
