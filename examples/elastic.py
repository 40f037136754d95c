"""Training that goes on without a rank that dies: catch, revoke, shrink, agree on the step, go on.

Every rank holds the same weights of a logistic regression (NumPy, float64).
Each step splits its batch into one share per rank; each rank's gradient over
its share is summed with one all_reduce. In the middle of step --die-at, rank
--victim kills itself (SIGKILL: no goodbye, no exit handler). The survivors:

    try:    all_reduce(grads)                         fails: PeerLostError (or RevokedError)
    except: comm.revoke()                             every survivor leaves the old communicator
            comm = comm.shrink()                      the survivors, renumbered 0..n-2
            last = all_reduce([steps done], op=min)   a survivor that finished the step rolls back
            redo the step with one share per survivor

Run it (the launcher must let the survivors run on, and still exits non-zero
because a rank died):

    tcoll run -n 4 --keep-going examples/elastic.py --check
    TCOLL_TRANSPORT=tcp tcoll run -n 4 --keep-going examples/elastic.py --check

With --check, rank 0 trains the same schedule alone (the batch of every step
before --die-at in one share per starting rank, from there on in one share
per survivor) and fails unless the weights agree to 1e-9.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import numpy as np

import tcoll

FEATURES = 8
TOLERANCE = 1e-9


def batch(step: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Step `step`'s samples (X, y), the same on every rank."""
    rng = np.random.default_rng(1000 + step)
    X = rng.standard_normal((size, FEATURES))
    y = (X @ np.linspace(-1.0, 1.0, FEATURES) + 0.3 * rng.standard_normal(size) > 0).astype(np.float64)
    return X, y


def share_gradient(w: np.ndarray, X: np.ndarray, y: np.ndarray, share: int, shares: int) -> np.ndarray:
    """The gradient of the mean log-loss over the batch, summed over share `share` of `shares` only."""
    rows = np.array_split(np.arange(len(X)), shares)[share]
    p = 1.0 / (1.0 + np.exp(-(X[rows] @ w)))
    return X[rows].T @ (p - y[rows]) / len(X)


def reference(args: argparse.Namespace, before: int, after: int) -> np.ndarray:
    """The weights one process gets with the job's schedule: `before` shares per batch until --die-at, then `after`."""
    w = np.zeros(FEATURES)
    for step in range(args.steps):
        X, y = batch(step, args.batch)
        shares = before if step < args.die_at else after
        w -= args.lr * sum(share_gradient(w, X, y, s, shares) for s in range(shares))
    return w


def train(comm: tcoll.Communicator, args: argparse.Namespace) -> tuple[tcoll.Communicator, np.ndarray]:
    """Data-parallel steps; on a death, go on with the survivors. Returns (the communicator at the end, w)."""
    w = np.zeros(FEATURES)
    done, before = 0, w.copy()  # steps every rank finished; the weights before the last one
    while done < args.steps:
        X, y = batch(done, args.batch)
        grads = share_gradient(w, X, y, comm.rank, comm.size)
        if done == args.die_at and comm.rank == args.victim and comm.size == args.ranks:
            os.kill(os.getpid(), signal.SIGKILL)  # in the middle of the step, its share unsent
        try:
            comm.all_reduce(grads)
        except (tcoll.PeerLostError, tcoll.RevokedError, tcoll.PeerFailedError) as exc:
            print(f"rank {comm.rank}: step {done}: {type(exc).__name__}: {exc}", flush=True)
            comm.revoke()
            comm = comm.shrink()
            # A survivor may have finished the step before the failure showed: take the step every one finished.
            last = comm.all_reduce(np.array([done], dtype=np.int64), op="min")[0]
            if last < done:
                w, done = before, int(last)
            continue
        before = w.copy()
        w -= args.lr * grads
        done += 1
    return comm, w


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--die-at", type=int, default=17, help="the step in whose middle the victim dies")
    parser.add_argument("--victim", type=int, default=2, help="the rank that dies (-1: none)")
    parser.add_argument("--batch", type=int, default=120)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--check", action="store_true", help="rank 0 compares with one process")
    args = parser.parse_args()
    comm = tcoll.init()
    args.ranks = comm.size
    first = comm.rank
    comm, w = train(comm, args)
    everyone = comm.all_gather(w)
    print(f"rank {first} (now {comm.rank} of {comm.size}): w[:3] = {np.round(w[:3], 6)}", flush=True)
    if comm.rank == 0:
        assert np.allclose(everyone, w, rtol=0, atol=0), "the survivors' weights differ"
        if args.check:
            expected = reference(args, args.ranks, comm.size)
            error = float(np.max(np.abs(w - expected)))
            print(f"check: {comm.size} survivors of {args.ranks}; largest difference from one process "
                  f"{error:.2e} ({'OK' if error <= TOLERANCE else 'FAILED'})", flush=True)
            if error > TOLERANCE:
                return 1
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
