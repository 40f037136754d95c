#!/usr/bin/env bash
# One device call: GPU checks (NCCL binding probe, staging tests, staging bench) then the 16-core tables.
set -u
cd "$(dirname "$0")/.."
R=/tmp/round; mkdir -p $R
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
nproc; lscpu | grep -E "Model name|^CPU\(s\)"
MPIEXEC=$(find /tmp/site -name mpiexec -type f 2>/dev/null | head -1); echo "mpiexec: $MPIEXEC"
python3 -c "from mpi4py import MPI; print(MPI.Get_library_version()[:60])" 2>&1 | tail -1
( OUT=$R/gpu TESTS_TIMEOUT=200 bash scripts/gpu_check.sh > $R/gpu_check.txt 2>&1; echo "gpu_check rc $?" >> $R/gpu_check.txt ) 
tail -n 25 $R/gpu_check.txt
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
timeout 60 python3 scripts/nccl_probe.py > $R/nccl_probe.txt 2>&1; echo "probe rc $?" >> $R/nccl_probe.txt; cat $R/nccl_probe.txt | tail -20
timeout 70 python3 benchmarks/gpu_staging.py --sizes 1M,16M,64M > $R/staging.txt 2>&1; echo "staging rc $?" >> $R/staging.txt; tail -8 $R/staging.txt
end=$((SECONDS + ${BUDGET:-230}))
RANKS="16 8 4 2" MPIEXEC=$MPIEXEC SWEEP_TIMEOUT=60 timeout $((end - SECONDS)) bash benchmarks/many_cores.sh $R/mc copy bench
timeout $((end - SECONDS)) bash benchmarks/many_cores.sh $R/mc thresholds
cat $R/mc/many_cores.md | grep -vE "^\s*$" | tail -n 120
tar czf $OUT/round.tar.gz -C /tmp round
