"""torch's own distributed test suite on the tcoll backend, against gloo on the same machine.

    python scripts/torch_suite.py                          # gloo, then tcoll, WORLD_SIZE=3; what differs
    python scripts/torch_suite.py --backend tcoll -k sparse -k all_gather_coalesced
    python scripts/torch_suite.py --backend gloo --json gloo.json
    python scripts/torch_suite.py --backend tcoll --only-passed gloo.json    # what gloo passed, on tcoll

The suite is `torch/testing/_internal/distributed/distributed_test.py`, which
ships in the torch wheel (torch's own runner, test/distributed/
test_distributed_spawn.py, does not). Each test spawns WORLD_SIZE processes
that meet through a file store, as torch's runner does.

The suite gates its tests on the module-level BACKEND it reads at import
("gloo", "nccl", ...) and knows nothing of "tcoll". So the module is always
imported with BACKEND=gloo, which evaluates every gate, and every
`BACKEND == "gloo"` inside a test, as for gloo; with --backend tcoll, every
`init_process_group` and `new_group` that asks for "gloo" gets "tcoll"
instead. What cannot pass that way: test_get_backend (it expects
`get_backend()` to say "gloo") and the monitored_barrier tests (torch
implements monitored_barrier for gloo groups only).

One test at a time (a test's processes take the machine's cores); a full run
is long (most of the 290 tests spawn WORLD_SIZE ranks): `-k` and `--only-passed`
cut it down.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest

_SWAP = "TCOLL_SUITE_BACKEND"  # set in the runner's processes (and inherited by the tests' ranks)
# The tests that only gloo can pass (see above).
GLOO_ONLY = ("test_get_backend", "test_monitored_barrier_allreduce_hang",
             "test_monitored_barrier_allreduce_hang_wait_all_ranks", "test_monitored_barrier_failure_order",
             "test_monitored_barrier_gloo", "test_monitored_barrier_gloo_rank_0_timeout",
             "test_monitored_barrier_gloo_subgroup", "test_monitored_barrier_wait_all_ranks")


def _prepare_module() -> type | None:
    """Import the suite with gloo's gates; with TCOLL_SUITE_BACKEND=tcoll, send its "gloo" groups to tcoll.

    Runs at import of this file, in the runner and in every rank the tests
    spawn (spawn re-imports this file as the ranks' main module).
    """
    backend = os.environ.get(_SWAP)
    if backend is None:
        return None
    os.environ["BACKEND"] = "gloo"
    os.environ.setdefault("WORLD_SIZE", "3")
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if backend == "tcoll":
        import tcoll.torch  # noqa: F401 - registers the backend

        _swap_backend(dist, c10d, "gloo", "tcoll")
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        """torch's suite, each test in WORLD_SIZE spawned processes (as torch's test_distributed_spawn.py)."""

        def setUp(self) -> None:
            super().setUp()
            self._spawn_processes()

    TestDistBackendWithSpawn.__module__ = __name__
    TestDistBackendWithSpawn.__qualname__ = "TestDistBackendWithSpawn"
    return TestDistBackendWithSpawn


def _swap_backend(dist, c10d, old: str, new: str) -> None:
    """Make init_process_group and new_group (both namespaces) use `new` where they are asked for `old`."""

    def swapped(fn):
        def call(*args, **kwargs):
            backend = kwargs.get("backend")
            if isinstance(backend, str) and backend.lower() == old:
                kwargs["backend"] = new
            return fn(*args, **kwargs)

        call.__wrapped__ = fn
        call.__name__ = fn.__name__
        return call

    for name in ("init_process_group", "new_group"):
        original = getattr(c10d, name)
        setattr(c10d, name, swapped(original))
        setattr(dist, name, getattr(c10d, name))


TestDistBackendWithSpawn = _prepare_module()


class _Outcomes(unittest.TextTestResult):
    """Records each test's outcome: passed, failed, error, skipped."""

    save_to: str | None = None  # written after every test, so an interrupted run keeps what it found

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, str] = {}
        self.details: dict[str, str] = {}

    def stopTest(self, test):  # noqa: N802
        super().stopTest(test)
        if self.save_to:
            with open(self.save_to, "w") as handle:
                json.dump({"outcomes": self.outcomes, "details": self.details, "seconds": 0.0}, handle, indent=1)

    def _name(self, test: unittest.TestCase) -> str:
        return test.id().split(".")[-1]

    def addSuccess(self, test):  # noqa: N802 - unittest's name
        super().addSuccess(test)
        self.outcomes[self._name(test)] = "passed"

    def addFailure(self, test, err):  # noqa: N802
        super().addFailure(test, err)
        self.outcomes[self._name(test)] = "failed"
        self.details[self._name(test)] = self.failures[-1][1][-2000:]

    def addError(self, test, err):  # noqa: N802
        super().addError(test, err)
        self.outcomes[self._name(test)] = "error"
        self.details[self._name(test)] = self.errors[-1][1][-2000:]

    def addSkip(self, test, reason):  # noqa: N802
        super().addSkip(test, reason)
        self.outcomes[self._name(test)] = "skipped"


def _run_here(patterns: list[str], only: set[str] | None, verbose: bool, save_to: str | None = None) -> dict:
    """Run the selected tests of the suite in this process (the module was prepared at import)."""
    loader = unittest.TestLoader()
    names = loader.getTestCaseNames(TestDistBackendWithSpawn)
    chosen = [n for n in names if (not patterns or any(p in n for p in patterns)) and (only is None or n in only)]
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in chosen)
    _Outcomes.save_to = save_to
    runner = unittest.TextTestRunner(resultclass=_Outcomes, verbosity=2 if verbose else 1, stream=sys.stderr)
    start = time.perf_counter()
    result = runner.run(suite)
    return {"outcomes": result.outcomes, "details": result.details, "seconds": time.perf_counter() - start}


def _run_backend(backend: str, args: argparse.Namespace, only: set[str] | None) -> dict:
    """Run the suite for `backend` in a fresh interpreter (the module must be imported with its settings)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--backend", backend, "--json", out,
                   "--world-size", str(args.world_size)]
        for pattern in args.k:
            command += ["-k", pattern]
        if only is not None:
            listed = os.path.join(tmp, "only.json")
            with open(listed, "w") as handle:
                json.dump({"outcomes": {n: "passed" for n in only}}, handle)
            command += ["--only-passed", listed]
        if args.verbose:
            command.append("-v")
        subprocess.run(command, check=False)
        with open(out) as handle:
            return json.load(handle)


def _summary(backend: str, result: dict) -> str:
    counts: dict[str, int] = {}
    for outcome in result["outcomes"].values():
        counts[outcome] = counts.get(outcome, 0) + 1
    parts = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    return f"{backend}: {parts} ({result['seconds']:.0f} s)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("gloo", "tcoll", "both"), default="both")
    parser.add_argument("-k", action="append", default=[], help="run only tests whose name contains this (repeatable)")
    parser.add_argument("--only-passed", help="run only the tests a previous --json run passed")
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--json", help="write each test's outcome (and failures' tracebacks) here")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    only = None
    if args.only_passed:
        with open(args.only_passed) as handle:
            only = {n for n, o in json.load(handle)["outcomes"].items() if o == "passed"}
    if args.backend != "both" and TestDistBackendWithSpawn is not None:
        result = _run_here(args.k, only, args.verbose, args.json)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(result, handle, indent=1)
        print(_summary(args.backend, result))
        return 0 if all(o in ("passed", "skipped") for o in result["outcomes"].values()) else 1
    if args.backend != "both":  # re-run with the module prepared for this backend
        os.environ[_SWAP], os.environ["WORLD_SIZE"] = args.backend, str(args.world_size)
        return subprocess.run([sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:])]).returncode
    os.environ["WORLD_SIZE"] = str(args.world_size)
    results = {}
    for backend in ("gloo", "tcoll"):
        os.environ[_SWAP] = backend
        results[backend] = _run_backend(backend, args, only)
        print(_summary(backend, results[backend]), flush=True)
    gloo, ours = results["gloo"]["outcomes"], results["tcoll"]["outcomes"]
    missing = sorted(n for n, o in gloo.items() if o == "passed" and ours.get(n) != "passed")
    expected = [n for n in missing if n in GLOO_ONLY]
    unexpected = [n for n in missing if n not in GLOO_ONLY]
    print(f"gloo passes, tcoll does not: {len(missing)} ({len(expected)} gloo-only: {', '.join(expected) or '-'})")
    for name in unexpected:
        detail = results["tcoll"]["details"].get(name, "")[-600:].replace("\n", "\n    ")
        print(f"  {name}: {ours.get(name)}\n    {detail}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
