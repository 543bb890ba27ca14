"""Activation offload for checkpointed blocks, with a recompute that repeats no CP communication.

:func:`offload_checkpoint` is a drop-in checkpointing function: diffusers' ``enable_gradient_checkpointing``
calls it as ``_gradient_checkpointing_func(block, *args)``, torch's ``CheckpointWrapper`` as
``checkpoint_fn(block, *args, **kwargs)``. It runs torch's non-reentrant checkpoint of the block with two
changes:

* **The block's inputs live on the CPU until backward.** Non-reentrant checkpoint saves the region's tensor
  arguments first (``_CheckpointFrame.save_inputs``, a ``SavedVariable`` per tensor in torch 2.13; older
  releases went through ``_NoopSaveInputs.save_for_backward``) and only then installs its own saved-tensor
  hooks for what the block saves inside. An outer ``torch.autograd.graph.save_on_cpu`` therefore packs
  exactly those inputs, and nothing the block computes. On CUDA the copies go to pinned memory with
  ``non_blocking`` copies both ways; on a CPU-only machine the inputs already live in host memory and are
  kept as they are (``tensor.cpu()`` of a CPU tensor is the tensor itself, so nothing is copied).
* **Selective checkpointing keeps the CP collectives' outputs** (:func:`cp_checkpoint_policy`): the ops
  in :data:`CP_COLLECTIVE_OPS` are ``MUST_SAVE``, so the recompute in backward reads the forward's
  all-to-all / all-gather / ring-attention results from the checkpoint's cache instead of communicating
  again; everything else is recomputed. Those cached outputs stay where they were computed (on the
  accelerator): SAC's cache holds them, not the saved-tensor hooks.

What the dispatcher sees (measured): Ulysses' all-to-all (``collectives._all_to_all``) and the key-mask
all-gather (``collectives.all_gather_no_grad``) are the functional ``_c10d_functional.all_to_all_single`` /
``all_gather_into_tensor`` (+ ``wait_tensor``); ring attention is one ``cp_lightning::ring_attention_forward``
custom op (its P2P exchange happens inside it, unseen). The in-place ``c10d`` ops that ``dist.*`` calls
dispatch (``c10d.alltoall_base_`` ...) return only a ``Work`` handle and fill their output in place, which
SAC cannot cache; they are left to recompute (FSDP2's parameter all-gathers in a block's pre-forward hook
are such ops, and must run again in backward anyway).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import cp_lightning.ring  # noqa: F401  (registers cp_lightning::ring_attention_forward)
from cp_lightning import collectives

__all__ = [
    "CP_COLLECTIVE_OPS",
    "apply_activation_offload",
    "check_activation_offload",
    "check_offload_option",
    "cp_checkpoint_policy",
    "offload_checkpoint",
    "offloading",
]

_functional = torch.ops._c10d_functional

#: Ops whose outputs the recompute must not produce again: each one communicates.
CP_COLLECTIVE_OPS = frozenset(
    {
        _functional.all_to_all_single.default,  # Ulysses, forward and backward
        _functional.all_gather_into_tensor.default,  # key-padding masks, plan gathers
        _functional.reduce_scatter_tensor.default,
        _functional.all_reduce.default,
        _functional.wait_tensor.default,  # the cached result is complete: nothing is left to wait for
        torch.ops.cp_lightning.ring_attention_forward.default,  # ring and USP: the whole P2P ring, one op
    }
)


def cp_checkpoint_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpointing policy: ``MUST_SAVE`` the CP collectives (:data:`CP_COLLECTIVE_OPS`), recompute
    everything else (torch's ``create_selective_checkpoint_contexts`` calls it once per op in forward)."""
    return CheckpointPolicy.MUST_SAVE if func in CP_COLLECTIVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts():
    return create_selective_checkpoint_contexts(cp_checkpoint_policy)


def _saved_inputs_hooks() -> torch.autograd.graph.saved_tensors_hooks:
    """Where the checkpointed block's inputs are kept until backward (one instance per block call)."""
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


def offload_checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)``, with the inputs in CPU
    memory until backward and the CP collectives' outputs kept (see the module docstring).

    Positional tensor arguments are the ones offloaded (what diffusers passes); keyword arguments reach
    ``function`` as they are and are held by the checkpoint wherever they live.
    """
    calls = 0

    def region(*inner_args, **inner_kwargs):
        # the second call is the recompute: its collectives are answered from SAC's cache and send nothing,
        # so collectives.count_bytes must not count the Python calls that still happen around them
        nonlocal calls
        calls += 1
        recompute = calls > 1 and not torch.compiler.is_compiling()
        with collectives.uncounted() if recompute else nullcontext():
            return function(*inner_args, **inner_kwargs)

    with _saved_inputs_hooks():
        return checkpoint(region, *args, use_reentrant=False, context_fn=_contexts, **kwargs)


def check_offload_option(activation_offload: Any, *, compile: dict | None = None) -> bool:
    """Validate an ``activation_offload=`` option beside the adapter's checked ``compile=`` options (no
    collectives); returns it."""
    if not isinstance(activation_offload, bool):
        raise TypeError(
            f"activation_offload must be True or False, got {activation_offload!r} "
            f"({type(activation_offload).__name__})."
        )
    if activation_offload and compile is not None:
        # Measured on torch 2.13: a block compiled by inductor is one opaque `inductor_compiled_code` op to
        # selective checkpointing, so the recompute runs the whole block again, collectives included, and
        # the Ulysses gradients came out wrong (relative error 0.6); plain checkpointing + compile is exact.
        raise ValueError(
            "activation_offload=True cannot be combined with compile= in torch "
            f"{torch.__version__.split('+')[0]}: selective checkpointing cannot see the CP collectives inside a "
            "compiled block (inductor runs it as one op), so the recompute would communicate again and its "
            "gradients are not exact. Use one of them: compile= with plain gradient checkpointing, or "
            "activation_offload=True without compile=."
        )
    return activation_offload


def _checkpointed(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(kind, module) for every checkpointed block under ``module``: diffusers modules with
    ``gradient_checkpointing`` on, and torch ``CheckpointWrapper`` blocks."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, CheckpointWrapper

    found = []
    for name, sub in module.named_modules():
        if isinstance(sub, CheckpointWrapper):
            if sub.checkpoint_impl == CheckpointImpl.REENTRANT:
                raise ValueError(
                    f"activation_offload: {name or type(sub).__name__} is wrapped with reentrant checkpointing "
                    "(checkpoint_wrapper(..., checkpoint_impl=CheckpointImpl.REENTRANT)), which selective "
                    "checkpointing cannot run; use the default CheckpointImpl.NO_REENTRANT."
                )
            found.append(("wrapper", sub))
        elif getattr(sub, "gradient_checkpointing", False) is True and hasattr(sub, "_gradient_checkpointing_func"):
            found.append(("diffusers", sub))
    return found


def _targets(root: nn.Module, plan: Mapping | None) -> list[nn.Module]:
    from cp_lightning.data_parallel import plan_targets

    return [module for _, module, _ in plan_targets(root, plan)]


def check_activation_offload(
    root: nn.Module, plan: Mapping | None = None, *, enabled: bool = True, compile: dict | None = None
) -> None:
    """The adapters' check before they parallelize (local, no collectives).

    ``enabled`` (their ``activation_offload=True``): every module they parallelize
    (``data_parallel.plan_targets``) must have checkpointed blocks to offload. ``compile`` (their checked
    ``compile=`` options): no block may already checkpoint through :func:`offload_checkpoint` (a recipe's
    ``model.activation_offload`` sets it in ``configure_model``); see :func:`check_offload_option`.
    """
    if compile is not None and offloading(root):
        check_offload_option(True, compile=compile)  # raises, with the reason
    if not enabled:
        return
    for module in _targets(root, plan):
        if not _checkpointed(module):
            raise ValueError(
                f"activation_offload=True offloads the inputs of checkpointed blocks, but {type(module).__name__} "
                "checkpoints none. Enable gradient checkpointing first: model.enable_gradient_checkpointing() "
                "(diffusers; in a LightningModule's configure_model, or before prepare), or wrap the blocks with "
                "torch's checkpoint_wrapper; or drop activation_offload."
            )


def apply_activation_offload(root: nn.Module, plan: Mapping | None = None) -> int:
    """Make every checkpointed block of the parallelized modules checkpoint through :func:`offload_checkpoint`.

    diffusers' blocks get it as their ``_gradient_checkpointing_func`` (what
    ``enable_gradient_checkpointing(gradient_checkpointing_func=...)`` sets), ``CheckpointWrapper`` blocks as
    their ``checkpoint_fn`` (their own checkpoint keyword arguments are replaced). Call it after
    :func:`cp_lightning.parallelize` and before compiling and data-parallel wrapping. Local (no
    collectives); idempotent. Returns the number of modules changed.
    """
    check_activation_offload(root, plan)
    changed = 0
    for module in _targets(root, plan):
        for kind, sub in _checkpointed(module):
            if kind == "wrapper":
                sub.checkpoint_fn = offload_checkpoint
            else:
                sub._gradient_checkpointing_func = offload_checkpoint
            changed += 1
    return changed


def offloading(module: nn.Module) -> bool:
    """Whether some checkpointed block under ``module`` checkpoints through :func:`offload_checkpoint`."""
    return any(
        getattr(sub, "checkpoint_fn", None) is offload_checkpoint
        or getattr(sub, "_gradient_checkpointing_func", None) is offload_checkpoint
        for sub in module.modules()
    )
