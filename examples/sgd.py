"""Data-parallel SGD: every rank computes gradients on its shard of each batch, all_reduce sums them.

A two-layer MLP written in NumPy (tanh hidden layer, logistic output,
cross-entropy loss) learns a synthetic binary classification task. Every rank
holds the same weights; each batch is split across the ranks, and the
gradients are summed with one all_reduce per step, so every rank applies the
same update, as in this pseudo-code:

    for all i: grads[i] = calculate_gradients(network, x_j, w_i, ground_truth_j)
    allreduce(grads, SUM)            # in place
    grads /= num_processors          # (here: each rank weights its shard, see below)
    for all i: update(w_i, grads[i])

Run it with the launcher, or alone (a world of one rank):

    tcoll run -n 4 examples/sgd.py
    tcoll run -n 3 examples/sgd.py --check    # 64-sample batches split 22/21/21
    python examples/sgd.py --check

With --check, rank 0 also trains the same model in this one process on whole
batches, and the script fails unless the final weights agree with it, and
with every rank's, to within rtol=1e-9, atol=1e-12 (float64 throughout; only
the order of the additions differs).
"""

from __future__ import annotations

import argparse

import numpy as np

import tcoll

FEATURES, HIDDEN, SAMPLES = 10, 16, 1024
N_PARAMS = FEATURES * HIDDEN + HIDDEN + HIDDEN + 1  # W1, b1, w2, b2
RTOL, ATOL = 1e-9, 1e-12  # for comparing weights and losses


def make_data(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The synthetic data set: X (SAMPLES, FEATURES) and labels y in {0, 1} (not linearly separable)."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((SAMPLES, FEATURES))
    y = (X[:, 0] * X[:, 1] + 0.5 * X[:, 2] > 0).astype(np.float64)
    return X, y


def unpack(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Views (W1, b1, w2, b2) into one flat array, so that a single all_reduce moves every gradient."""
    W1, b1, w2, b2 = np.split(flat, np.cumsum([FEATURES * HIDDEN, HIDDEN, HIDDEN]))
    return W1.reshape(FEATURES, HIDDEN), b1, w2, b2


def init_params(seed: int) -> np.ndarray:
    """The initial weights, all in one flat float64 array."""
    rng = np.random.default_rng(seed + 1)
    params = np.zeros(N_PARAMS)
    W1, _, w2, _ = unpack(params)
    W1[:] = rng.standard_normal(W1.shape) / np.sqrt(FEATURES)
    w2[:] = rng.standard_normal(w2.shape) / np.sqrt(HIDDEN)
    return params


def forward(params: np.ndarray, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The hidden activations h and the logits z of the samples X."""
    W1, b1, w2, b2 = unpack(params)
    h = np.tanh(X @ W1 + b1)
    return h, h @ w2 + b2


def gradients(params: np.ndarray, X: np.ndarray, y: np.ndarray, scale: float, grads: np.ndarray) -> float:
    """Write `scale` times the summed gradient of the loss over the samples (X, y) into `grads`.

    Returns:
        The summed loss over these samples.
    """
    w2 = unpack(params)[2]
    gW1, gb1, gw2, gb2 = unpack(grads)
    h, z = forward(params, X)
    loss = np.sum(np.logaddexp(0.0, z) - y * z)  # cross-entropy of sigmoid(z), computed stably
    dz = (1.0 / (1.0 + np.exp(-z)) - y) * scale
    gw2[:] = h.T @ dz
    gb2[:] = dz.sum()
    dh = np.outer(dz, w2) * (1.0 - h * h)
    gW1[:] = X.T @ dh
    gb1[:] = dh.sum(axis=0)
    return float(loss)


def train(X: np.ndarray, y: np.ndarray, args: argparse.Namespace,
          comm: tcoll.Communicator | None = None) -> tuple[np.ndarray, list[float]]:
    """Train with SGD; with `comm`, data-parallel over its ranks, else alone on whole batches.

    Returns:
        The final weights (flat) and the mean loss of every epoch.
    """
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    params = init_params(args.seed) if rank == 0 else np.empty(N_PARAMS)
    if comm is not None:
        comm.broadcast(params, root=0)  # every rank starts from rank 0's weights
    grads = np.zeros_like(params)
    order = np.random.default_rng(args.seed + 2)  # the same shuffles on every rank
    losses = []
    for _ in range(args.epochs):
        perm = order.permutation(len(X))
        loss = np.zeros(1)
        for start in range(0, len(X), args.batch_size):
            batch = perm[start:start + args.batch_size]
            mine = np.array_split(batch, size)[rank]  # this rank's shard; sizes may differ by one
            # Each rank's gradient sums over its shard and divides by the whole batch's size,
            # so the sum over the ranks is the batch's mean gradient even for unequal shards
            # (with equal shards this is the pseudo-code's allreduce(SUM) and /= num_processors).
            loss += gradients(params, X[mine], y[mine], 1.0 / len(batch), grads)
            if comm is not None:
                comm.all_reduce(grads, op="sum")
            params -= args.lr * grads
        if comm is not None:
            comm.all_reduce(loss, op="sum")
        losses.append(loss[0] / len(X))
    return params, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="samples per step, over all ranks")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true",
                        help="compare with training in one process (rank 0) and across ranks")
    args = parser.parse_args()

    comm = tcoll.init()
    X, y = make_data(args.seed)  # every rank makes all the data; it only reads its shards
    params, losses = train(X, y, args, comm)
    if args.check:
        everyone = comm.all_gather(params)
        if not all(np.allclose(other, params, RTOL, ATOL) for other in everyone):
            raise SystemExit(f"rank {comm.rank}: the ranks ended with different weights")
    if comm.rank == 0:
        if args.check:  # the same training, in this process alone, on whole batches
            reference, ref_losses = train(X, y, args)
        for epoch, loss in enumerate(losses, 1):
            alone = f" (single process {ref_losses[epoch - 1]:.6f})" if args.check else ""
            print(f"epoch {epoch:3d}: loss {loss:.6f}{alone}")
        accuracy = np.mean((forward(params, X)[1] > 0) == y)
        print(f"trained on {comm.size} rank(s): training accuracy {accuracy:.3f}")
        if args.check:
            diff = np.max(np.abs(params - reference))
            if not np.allclose(params, reference, RTOL, ATOL) or not np.allclose(losses, ref_losses, RTOL, ATOL):
                raise SystemExit(f"weights differ from single-process training (max abs difference {diff:.3g})")
            print(f"weights agree on all {comm.size} rank(s)")
            print(f"weights match single-process training (max abs difference {diff:.3g})")
    comm.close()


if __name__ == "__main__":
    main()
