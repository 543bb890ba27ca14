"""torch.compile for context-parallel models: the repeated blocks, fullgraph, in the right order.

The order (torchtitan's): :func:`cp_lightning.parallelize` (split hooks, attention routing) ->
activation checkpointing -> :func:`compile_blocks` -> data-parallel wrapping (DDP or FSDP2). Only each
block's ``forward`` is compiled, the way diffusers' ``compile_repeated_blocks`` picks the blocks
(``_repeated_blocks``): module hooks (cp_lightning's split hooks on ``blocks.0``, FSDP's
unshard/reshard hooks, checkpoint wrappers) stay outside the graphs, and one graph serves every block
of a class. ``fullgraph=True`` is the default: under CP nothing breaks a graph (ring attention is a
custom op, shard lengths are looked up at trace time, the consistency check and byte counters live in
custom ops), so a break is a bug to report, not a cost to pay silently.

``torch.compile(model, fullgraph=True)`` on the whole parallelized model works as well; the options
refused below apply to it in the same way.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["compile_blocks", "compile_options", "compile_targets", "repeated_blocks"]

_KEYS = ("backend", "mode", "options", "dynamic", "fullgraph")


def _cuda_graph_modes() -> tuple[str, ...]:
    # CUDA graphs replay kernels without running Python: the ring's P2P exchange, the consistency check
    # and the byte counters (host-side work inside cp_lightning's custom ops) would silently not happen.
    import torch._inductor

    return tuple(mode for mode, opts in torch._inductor.list_mode_options().items() if opts.get("triton.cudagraphs"))


def compile_options(compile: bool | Mapping | None) -> dict | None:
    """Validate a ``compile=`` option (True, False/None, or torch.compile keyword arguments).

    Returns the keyword arguments for ``torch.compile`` (``fullgraph=True`` and ``dynamic=False`` unless
    given), or None when compiling is off. Raises before anything is compiled or communicated, for what
    torch.compile would refuse only when the blocks are compiled (an unknown backend, mode or inductor
    option; mode and options together) and for what the compiled CP path cannot honour (CUDA graphs,
    dynamic shapes, inductor settings given to a backend that ignores them).
    """
    if compile is None or compile is False:
        return None
    import torch._inductor

    if compile is True:
        compile = {}
    if not isinstance(compile, Mapping):
        raise TypeError(
            f"compile must be True, False or a dict of torch.compile arguments (e.g. {{'backend': 'inductor'}}), "
            f"got {type(compile).__name__}."
        )
    unknown = sorted(set(compile) - set(_KEYS))
    if unknown:
        raise TypeError(f"compile= got unknown torch.compile arguments {unknown}; it takes {list(_KEYS)}.")
    backend = compile.get("backend", "inductor")
    mode = compile.get("mode")
    options = compile.get("options") or {}
    if isinstance(backend, str) and backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(
            f"compile backend {backend!r} is not a torch.compile backend; choose one of "
            f"{torch._dynamo.list_backends()} (or 'aot_eager', 'eager' for debugging)."
        )
    if mode is not None and options:
        raise ValueError(f"compile: pass mode ({mode!r}) or options, not both (torch.compile takes one of them).")
    if mode is not None and mode not in torch._inductor.list_mode_options():
        raise ValueError(
            f"compile mode {mode!r} is unknown; choose one of {list(torch._inductor.list_mode_options())}."
        )
    if not isinstance(options, Mapping):
        raise TypeError(f"compile options must be a dict of inductor settings, got {type(options).__name__}.")
    bad = sorted(set(options) - set(torch._inductor.list_options()))
    if bad:
        raise ValueError(f"compile options {bad} are not inductor settings (see torch._inductor.list_options()).")
    if (mode is not None or options) and backend != "inductor":
        raise ValueError(
            f"compile mode/options are inductor's settings, which backend {backend!r} would silently ignore; "
            "drop them or use backend='inductor'."
        )
    if backend == "cudagraphs" or mode in _cuda_graph_modes() or options.get("triton.cudagraphs"):
        what = f"mode {mode!r}" if mode else ("backend 'cudagraphs'" if backend == "cudagraphs" else "options")
        raise ValueError(
            f"compile {what} (CUDA graphs) cannot run "
            "context-parallel attention: a graph replay skips the host-side work of the ring exchange and of the "
            "consistency check. Use mode='default' or 'max-autotune-no-cudagraphs'."
        )
    if compile.get("dynamic") is True:
        raise ValueError(
            "compile dynamic=True: context parallelism needs every rank's sequence length while tracing (the "
            "shard lengths are looked up, not exchanged); use dynamic=False (one graph per sequence length)."
        )
    return {"fullgraph": True, "dynamic": False, **compile}


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The submodules whose class is named in ``module._repeated_blocks`` (diffusers' transformer blocks)."""
    names = getattr(module, "_repeated_blocks", None)
    if not names:
        raise ValueError(
            f"{type(module).__name__} has no `_repeated_blocks` (diffusers' list of its transformer block classes), "
            "so there are no blocks to compile. Compile the model yourself (torch.compile(model, fullgraph=True)) "
            "or set _repeated_blocks on its class."
        )
    blocks = [sub for sub in module.modules() if type(sub).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(module).__name__}._repeated_blocks names {list(names)}, but it has no such module.")
    return blocks


def compile_blocks(module: nn.Module, **compile_kwargs) -> nn.Module:
    """Compile ``module``'s repeated blocks in place (each block's ``forward``); returns ``module``.

    ``compile_kwargs`` go to ``torch.compile`` after :func:`compile_options` checks them (default
    ``fullgraph=True, dynamic=False``). Call it after :func:`cp_lightning.parallelize` and activation
    checkpointing, before DDP or FSDP wrapping. Blocks compiled already are left alone.
    """
    options = compile_options(compile_kwargs or True)
    for block in repeated_blocks(module):
        if not getattr(block, "_cp_lightning_compiled", False):
            block.forward = torch.compile(block.forward, **options)
            block._cp_lightning_compiled = True
    return module


def compile_targets(root: nn.Module, plan: Mapping | None, options: dict | None) -> None:
    """:func:`compile_blocks` on every module the adapters parallelize (``data_parallel.plan_targets``),
    with ``options`` from :func:`compile_options` (None: do nothing). For the strategies and Accelerate."""
    if options is None:
        return
    from cp_lightning.data_parallel import plan_targets

    for _, module, _ in plan_targets(root, plan):
        compile_blocks(module, **options)
