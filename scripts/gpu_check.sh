#!/usr/bin/env bash
# The GPU checks of tcoll, in one call on the device machine (one GPU, torch 2.11, CuPy, NCCL; no network).
#
#   run(command="bash scripts/gpu_check.sh", timeout_s=600)
#
# Builds tcoll's C kernels in place, then runs, with pytest:
#   tests/comm/test_staging.py   CUDA tensors (and CuPy arrays) in tcoll's own calls, through host staging:
#                                2 and 4 ranks sharing the GPU, every collective and send/recv on float32,
#                                bfloat16 and int64 against NumPy; a call queued behind a kernel still
#                                writing its input on a side stream; a mismatch -> MismatchError on every rank
#   tests/comm/test_nccl.py      tcoll's NCCL path at world size 1 (NCCL refuses two ranks on one GPU): every
#                                NCCL call against NumPy, the stream rule, a stuck call aborted and named; two
#                                ranks on the GPU: TCOLL_GPU=nccl refused by name, a mismatch raised on every rank
#   tests/torch/test_cuda.py     "cpu:tcoll,cuda:nccl" at world size 1: CUDA all_reduce on NCCL, CPU on tcoll
#   tests/torch/test_devices.py  the same routing without a GPU (meta:fake), as on CPU machines
#   tests/bench/test_bench_cuda.py  tcoll bench --device cuda: 2 ranks sharing the GPU with --check (#wrong 0),
#                                and 1 rank with --compare nccl (NCCL's rows present)
# Results go to $OUT (or /tmp/tcoll_gpu_check): env.txt, build.log, tests.log, junit.xml, summary.txt.
# Nothing needs carrying: numpy, ml_dtypes, pytest and pytest-timeout are on the machine's image.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/tcoll_gpu_check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
PY=python3

{
  date -u
  nvidia-smi -L 2>&1
  $PY - <<'PY' 2>&1
import importlib, sys
print("python", sys.version.split()[0])
import torch, torch.distributed as dist
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "nccl", dist.is_nccl_available() and torch.cuda.nccl.version())
for name in ("numpy", "ml_dtypes", "cupy", "pytest", "pytest_timeout"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except ImportError as exc:
        print(name, "MISSING", exc)
PY
} > "$OUT/env.txt"
cat "$OUT/env.txt"

$PY -c "from setuptools import setup; setup()" build_ext --inplace > "$OUT/build.log" 2>&1
build=$?
echo "build: exit $build (the kernels are optional: tcoll runs without them)"

timeout "${TESTS_TIMEOUT:-520}" $PY -m pytest -v -rs -p no:cacheprovider --junitxml="$OUT/junit.xml" \
  tests/comm/test_staging.py tests/comm/test_nccl.py tests/torch/test_cuda.py tests/torch/test_devices.py tests/bench/test_bench_cuda.py 2>&1 | tee "$OUT/tests.log"
tests=$?

{
  echo "build exit $build"
  echo "tests exit $tests"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/tests.log" | tail -n 5
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
exit "$tests"
