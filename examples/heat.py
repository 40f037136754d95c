"""The 1-D heat equation with a halo exchange: each rank holds a slab of the rod and trades edges by sendrecv.

The rod u(x) on [0, 1], its ends held at 0, starts as a hot bump and
diffuses (explicit finite differences, u += r * (u[i-1] - 2 u[i] + u[i+1]),
r = dt / dx^2 = 0.4 < 0.5, so the scheme is stable). The N inner points
are split into near-equal slabs, one per rank. Each slab carries one ghost
cell on either side; every step, rank k trades its edge values with its
neighbours in two sendrecv calls (rightward, then leftward), which never
deadlock whatever the order the ranks reach them in:

    rank k-1              rank k                 rank k+1
    [.. a b|g]      [g|c d .. e f|g]       [g|h i ..]
         b -------------> g      f ---------> g          sendrecv to the right, from the left
         g <------------- c      g <--------- h          sendrecv to the left, from the right

The end ranks exchange with nobody on their outer side (the ghost stays 0,
the boundary value). Afterwards rank 0 gathers the slabs and checks the
result against the same computation in one process (they must agree to the
last bit: the same additions in the same order) and against the exact
solution of the continuous problem (to the discretisation error).

    tcoll run -n 4 examples/heat.py
    python examples/heat.py             # a world of one rank
"""

from __future__ import annotations

import argparse

import numpy as np

import tcoll

R = 0.4  # dt / dx^2


def initial(n: int) -> np.ndarray:
    """The inner points' initial temperatures: sin(pi x) + 0.5 sin(3 pi x) (zero at both ends)."""
    x = np.arange(1, n + 1) / (n + 1)
    return np.sin(np.pi * x) + 0.5 * np.sin(3 * np.pi * x)


def exact(n: int, steps: int) -> np.ndarray:
    """The continuous solution at t = steps * dt: each sine mode decays as exp(-(k pi)^2 t)."""
    x = np.arange(1, n + 1) / (n + 1)
    t = steps * R / (n + 1) ** 2
    return np.exp(-np.pi ** 2 * t) * np.sin(np.pi * x) + 0.5 * np.exp(-9 * np.pi ** 2 * t) * np.sin(3 * np.pi * x)


def step(u: np.ndarray) -> None:
    """One explicit step on u[1:-1], ghosts u[0] and u[-1] given."""
    u[1:-1] += R * (u[:-2] - 2 * u[1:-1] + u[2:])


def solve_alone(n: int, steps: int) -> np.ndarray:
    """The reference: the whole rod in one process."""
    u = np.zeros(n + 2)
    u[1:-1] = initial(n)
    for _ in range(steps):
        step(u)
    return u[1:-1]


def slab(n: int, size: int, rank: int) -> tuple[int, int]:
    """The inner points [lo, hi) of `rank`'s slab (near-equal shares)."""
    share, extra = divmod(n, size)
    lo = rank * share + min(rank, extra)
    return lo, lo + share + (rank < extra)


def solve(comm: tcoll.Communicator, n: int, steps: int) -> np.ndarray:
    """This rank's slab after `steps` steps, edges traded by sendrecv each step."""
    rank, size = comm.rank, comm.size
    lo, hi = slab(n, size, rank)
    u = np.zeros(hi - lo + 2)  # ghost, the slab, ghost
    u[1:-1] = initial(n)[lo:hi]
    left, right = rank - 1, rank + 1
    for _ in range(steps):
        if size > 1:
            # Rightward: send my last value to the right, receive the left one's last into my left ghost.
            if 0 < rank < size - 1:
                comm.sendrecv(u[-2:-1], right, u[0:1], left, sendtag=1, recvtag=1)
                comm.sendrecv(u[1:2], left, u[-1:], right, sendtag=2, recvtag=2)
            elif rank == 0:
                comm.sendrecv(u[-2:-1], right, u[-1:], right, sendtag=1, recvtag=2)
            else:
                comm.sendrecv(u[1:2], left, u[0:1], left, sendtag=2, recvtag=1)
        step(u)
    return u[1:-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=203, help="inner points of the rod")
    parser.add_argument("--steps", type=int, default=2000, help="time steps")
    args = parser.parse_args()
    comm = tcoll.init()
    mine = solve(comm, args.points, args.steps)
    slabs = comm.gather_object(mine, root=0)
    if comm.rank == 0:
        whole = np.concatenate(slabs)
        alone = solve_alone(args.points, args.steps)
        if not np.array_equal(whole, alone):
            raise SystemExit(f"the {comm.size}-rank solution differs from one process's by "
                             f"{np.abs(whole - alone).max():.3g}")
        error = np.abs(whole - exact(args.points, args.steps)).max()
        if error > 1e-3:
            raise SystemExit(f"the solution is {error:.3g} away from the exact one")
        print(f"heat: {args.points} points, {args.steps} steps on {comm.size} rank(s): matches one process "
              f"exactly; max error against the exact solution {error:.2e}")
    comm.close()


if __name__ == "__main__":
    main()
