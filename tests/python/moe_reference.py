# SPDX-License-Identifier: Apache-2.0
"""What the Python tests compare with: a dense single-process MoE over every rank's tokens (each
token through its experts, one after the other), the problems they run, and the 4-process Gloo
harness. An expert here is a function of one expert's flat parameters and its rows."""

import math
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moecomm

RANKS = 4


def spawn(fn, *args):
    """Runs fn(rank, *args) in RANKS processes of one Gloo world; a failure in any fails the test."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(fn, os.path.join(d, "store"), args), nprocs=RANKS, join=True)


def _worker(rank, fn, store, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=RANKS)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def mlp(p, x, hidden, inner, activation="relu"):
    if activation == "swiglu":  # (silu(x Wg) * (x Wu)) W2, W1 = [Wg | Wu]
        a = x @ p[: 2 * hidden * inner].view(hidden, 2 * inner)
        return (torch.nn.functional.silu(a[:, :inner]) * a[:, inner:]) @ p[2 * hidden * inner:].view(inner, hidden)
    w1 = p[: hidden * inner].view(hidden, inner)
    b1 = p[hidden * inner: hidden * inner + inner]
    w2 = p[hidden * inner + inner: 2 * hidden * inner + inner].view(inner, hidden)
    b2 = p[2 * hidden * inner + inner:]
    return torch.addmm(b2, torch.relu(torch.addmm(b1, x, w1)), w2)


def mlp_of(hidden, inner, activation="relu"):
    """The built-in MLP expert as expert(params, rows)."""
    return lambda p, x: mlp(p, x, hidden, inner, activation)


def dense_moe(params, x, idx, w, expert):
    """y[t] = sum_k w[t][k] * expert(params[idx[t][k]], x[t]): every token through its experts, one process."""
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0:
                y[t] = y[t] + w[t, k] * expert(params[e], x[t:t + 1])[0]
    return y


def problem(seed, tokens, hidden, inner, experts, top_k, activation="relu"):
    """Every rank's inputs, the same on every process: x, routing (expert 0 hot, one masked slot), g."""
    g = torch.Generator().manual_seed(seed)
    n = RANKS * tokens
    x = torch.randn(n, hidden, generator=g)
    idx = torch.randint(1, experts, (n, top_k), generator=g, dtype=torch.int32)
    idx[:, 0] = 0
    idx[1, top_k - 1] = -1
    w = torch.rand(n, top_k, generator=g)
    grad = torch.randn(n, hidden, generator=g)
    params = torch.randn(experts, moecomm.mlp_parameter_count(hidden, inner, activation), generator=g) * 0.3
    return x, idx, w, grad, params


def gathered(t):
    parts = [torch.empty_like(t) for _ in range(RANKS)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def assert_equals_dense(y, xr, wr, params, x, idx, w, grad, expert):
    """This rank's output and input gradients (of x and w) equal the dense MoE's rows, its loss being
    sum(y * grad) over every rank; returns the dense parameters' gradient."""
    p = params.clone().requires_grad_(True)
    xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref = dense_moe(p, xs, idx, ws, expert)
    (ref * grad).sum().backward()
    torch.testing.assert_close(gathered(y.detach()), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gathered(xr.grad), xs.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gathered(wr.grad), ws.grad, rtol=1e-5, atol=1e-5)
    return p.grad


def capacity(tokens, top_k, experts, factor, min_capacity=0):
    """Semantics §7: C = max(ceil(T K / E * factor), min_capacity), division first (every rank has T)."""
    return max(math.ceil(tokens * top_k / experts * factor), min_capacity)


def kept_by_rule(idx, w, experts, cap, drop):
    """The slots of one rank's routing idx [T][K] that survive capacity `cap` per expert: "position"
    keeps each expert's first slots in (t, k) order, "probs" its largest weights (ties: lower token,
    then lower slot). A bool [T][K]."""
    kept = torch.zeros(idx.shape, dtype=torch.bool)
    for e in range(experts):
        slots = [(t, k) for t in range(idx.shape[0]) for k in range(idx.shape[1]) if int(idx[t, k]) == e]
        if drop == "probs":
            slots.sort(key=lambda s: (-float(w[s]), s[0], s[1]))
        for s in slots[:cap]:
            kept[s] = True
    return kept
