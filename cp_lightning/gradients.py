"""The gradient rule of gathers: which backward each forward's gathers use, decided per forward pass.

Convention (DESIGN.md section 2): after ``backward()`` the SUM over the CP group of each rank's
gradient is the single-device gradient. For a tensor every rank holds a copy of (replicated: the
inputs, everything after a gather), each rank's gradient is then a *partial* one, the full gradient
being the sum of the copies' gradients; for a tensor each rank holds a shard of, each rank's gradient
is the *full* gradient of its shard. Every operation's backward is linear in its incoming gradient and
identical on every rank for replicated data, so partial gradients stay partial through any layer,
parameters included; a split (``narrow``) hands rank r's full shard gradient to its slice of the
replicated input, a valid partial gradient. Two places need care:

* **The loss.** Every rank computes the same loss from the same replicated outputs, so each rank's
  gradient of a root output is the full one, cp times its share: the general rule scales the root
  outputs' gradients by ``1/cp``.
* **A gather** turns shards into a replicated tensor. The full gradient of this rank's shard is its
  slice of the *sum* of the ranks' partial gradients: the general rule reduce-scatters the incoming
  gradient (into a fresh buffer: autograd may hand the same tensor to several branches, so its
  buffer is never reduced in place).

**The free slice.** When nothing after the gathers has trainable parameters (nor any other leaf that
requires grad), every gather's output reaches the outputs without passing another gather (no
re-split), and every output is gathered, the incoming gradient of each gather is the same on every
rank and is already the full gradient: this rank's slice of it is exact and costs no communication
(the root is then not scaled). :func:`free_slice_is_exact` proves this for each forward pass by
walking the autograd graph back from the root outputs until it meets gathers; the walk stops early,
so it costs a few nodes for the usual plans (Flux, Wan: one gather at ``proj_out``).

Loss-parallel mode (each rank's loss is its own shard's mean, DDP averages over dp x cp) keeps its
terminal gathers sharded and needs no 1/cp (the mean over ranks is the full loss's gradient), only,
for shards of different lengths, each rank's weight cp * S_r / S at the root; a gather that runs
there (one followed by a re-split) always reduce-scatters, since the ranks' incoming gradients differ.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree


class ForwardRecord:
    """What one forward pass of a parallelized module did, shared with its gathers' backward.

    ``free``: whether the gathers use the free slice (True) or reduce-scatter (False); None until the
    root forward ends, read by the backward. A record closes at the end of its forward: hooks that
    run again later (activation checkpointing recomputes blocks during backward) change nothing.
    """

    def __init__(self, loss_parallel: bool) -> None:
        self.loss_parallel = loss_parallel
        self.gathers = 0  # gathers run in this forward, numbered in order
        self.skipped: str | None = None  # loss-parallel: the first gather left sharded, by path
        self.weight = 1.0  # loss-parallel: cp * S_r / S, this rank's share of the tokens
        self.free: bool | None = None
        self.closed = False

    def note_skipped(self, path: str, weight: float) -> None:
        """Loss-parallel: the gather at ``path`` stays sharded; ``weight`` = cp * S_r / S for the loss."""
        if self.skipped is None:
            self.skipped, self.weight = path, weight
        elif abs(weight - self.weight) > 1e-12:
            raise ValueError(
                f"loss-parallel: the outputs gathered at {self.skipped!r} and {path!r} are split at different "
                "ratios over the CP ranks, so no one weighting of the ranks' losses is exact; train without "
                "loss_parallel."
            )

    def note_gather(self, ctx) -> None:
        """Tag a gather's autograd node so that the graph walk can recognise it."""
        ctx.cp_record, ctx.cp_index = self, self.gathers
        if not self.closed:
            self.gathers += 1


def _trainable_leaf(node) -> bool:
    return hasattr(node, "variable")  # AccumulateGrad: a leaf that requires grad


def free_slice_is_exact(outputs, record: ForwardRecord) -> bool:
    """Whether every gather of ``record`` may hand back its slice of the gradient (see the module doc).

    Walks back from the root outputs through everything computed on replicated data, stopping at
    the gathers of this forward. Exact when the walk meets no trainable leaf and meets every gather
    this forward ran (a gather reached only through another gather was followed by a re-split).
    """
    if record.gathers == 0:
        return False
    stack = []
    for t in pytree.tree_leaves(outputs):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            if t.grad_fn is None:
                return False  # a leaf returned as an output
            stack.append(t.grad_fn)
    seen, met = set(), set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if getattr(node, "cp_record", None) is record:
            met.add(node.cp_index)
            continue
        if _trainable_leaf(node):
            return False
        stack.extend(next_node for next_node, _ in node.next_functions)
    return len(met) == record.gathers


class ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``weight``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.weight, None


def finish_forward(outputs, record: ForwardRecord, cp: int):
    """Close ``record`` at the end of the root forward: decide the rule, scale the outputs if general."""
    if record.closed:
        return outputs
    record.closed = True
    if record.loss_parallel or not torch.is_grad_enabled():
        record.free = False  # loss-parallel: the gathers that run are followed by a re-split
        if record.weight == 1.0:
            return outputs
        return _scale_outputs(outputs, record.weight)
    if torch.compiler.is_compiling():
        record.free = False  # no autograd graph to walk while tracing: the general rule is always exact
    else:
        record.free = free_slice_is_exact(outputs, record)
    return outputs if record.free else _scale_outputs(outputs, 1.0 / cp)


def _scale_outputs(outputs, weight: float):
    def scale(t):
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
            return ScaleGrad.apply(t, weight)
        return t

    return pytree.tree_map(scale, outputs)
