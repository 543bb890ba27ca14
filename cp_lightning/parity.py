"""Parity of a tiny case under context parallelism: build it, run it in one process and under CP, compare.

The machinery under the plan checker (``python -m cp_lightning.check``, :mod:`cp_lightning.check_all`) and the
library's parity tests (tests/test_library.py): :func:`build` makes a tiny random-init instance of a case
(parameters initialised to zero, such as gates and output layers, given random values so that every path
carries a gradient), :class:`Reference` runs it forward and backward in one process, :func:`run_cp` runs it
under CP on a mesh and returns the output error and the CP-summed gradient error (:func:`grad_errors`), and
:func:`run_workers` runs a function on N gloo CPU processes. Tolerances: outputs :data:`OUT_TOL` absolute,
gradients :data:`GRAD_TOL` of the larger of the tensor's own gradient and :data:`SCALE_FLOOR` x the model's
largest (L2 norms).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import multiprocessing as mp
import os
import queue
import socket
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from cp_lightning.models import TinyCase
from cp_lightning.tiny import checkpoint, construct

OUT_TOL = 1e-5  # outputs, absolute (fp32)
GRAD_TOL = 1e-4  # gradients, relative: see grad_errors


# ---------------------------------------------------------------- building and running a case


def load_attr(ref: str, what: str = "--plan"):
    """The object ``module:attr`` names (``what``: the option, for the error)."""
    module, _, attr = ref.partition(":")
    if not module or not attr:
        raise ValueError(f"{what} takes module:attr (e.g. my_plans:WAN_PLAN), got {ref!r}.")
    try:
        return getattr(importlib.import_module(module), attr)
    except AttributeError:
        raise ValueError(f"{what} {ref!r}: module {module!r} has no attribute {attr!r}.") from None


def _model_class(name: str) -> type:
    """A library case's diffusers class by name, or a custom case's ``module:Class``."""
    if ":" in name:
        return load_attr(name, "model")
    import diffusers

    return getattr(diffusers, name)


def _wake(model: nn.Module, seed: int) -> None:
    """Give parameters initialised to zero (gates, output layers) small random values, so no path is silent."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.numel() and not p.any():
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))


def build(case: TinyCase, seed: int = 0) -> list[nn.Module]:
    """``case.experts`` tiny random-init instances (identical on every rank for the same seed)."""
    cls = _model_class(case.cls)
    models = []
    for expert in range(case.experts):
        torch.manual_seed(seed + expert)
        model = construct(cls, case.config)
        if case.setup is not None:  # what the model's pipeline sets on it (processors)
            case.setup(model)
        _wake(model, seed + 100 + expert)
        models.append(model)
    return models


def make_inputs(case: TinyCase, models, tokens: int, text_tokens: int | None = None, dtype=torch.float32):
    text = case.text_tokens if text_tokens is None else text_tokens
    generators = [torch.Generator().manual_seed(1 + i) for i in range(len(models))]
    return [case.inputs(model, g, 2, tokens, text, dtype) for model, g in zip(models, generators, strict=True)]


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in _tensors(item)]
    if hasattr(out, "to_tuple"):
        return _tensors(out.to_tuple())
    return []


def forward_backward(models, inputs) -> list[torch.Tensor]:
    """Run every expert, weight each output by fixed random weights, backward the sum; return the outputs."""
    outs, loss = [], 0.0
    for i, (model, kwargs) in enumerate(zip(models, inputs, strict=True)):
        # diffusers models return a tuple with return_dict=False; a plain module's forward may not take it
        extra = {"return_dict": False} if "return_dict" in inspect.signature(model.forward).parameters else {}
        for j, out in enumerate(_tensors(model(**kwargs, **extra))):
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + 31 * i + j))
            loss = loss + (out.float() * weights).sum()
            outs.append(out.detach().float())
    loss.backward()
    return outs


def grads(models) -> dict[str, torch.Tensor]:
    out = {}
    for i, model in enumerate(models):
        for n, p in model.named_parameters():
            out[f"{i}.{n}"] = p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p).float()
    return out


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max|got - ref| / max|ref| (absolute below 1e-8, where a relative figure means nothing)."""
    scale = ref.abs().max().item()
    err = (got - ref).abs().max().item()
    return err / scale if scale > 1e-8 else err


# A tensor's gradient is judged against the larger of its own norm and this fraction of its model's largest
SCALE_FLOOR = 1e-4


def grad_errors(got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Each tensor's gradient error ``||got - ref|| / max(||ref||, SCALE_FLOOR x max_t ||ref_t||)`` (L2 norms).

    The floor is the model's own gradient scale, its largest tensor gradient norm: a tensor whose true
    gradient vanishes by construction (a key bias: softmax ignores a shift shared by all keys) or nearly
    cancels over the tokens (Kandinsky 5's text key projection and norm) holds rounding noise of the size
    of its terms, not of its sum, and CP sums the ranks' partial terms in another order. Relative to itself
    that noise can read as 100%; relative to the model's scale it is what fp32 leaves, as for any tensor.
    Names are ``"<model index>.<parameter>"`` (:func:`grads`): each expert is scaled by its own gradients.
    """
    largest: dict[str, float] = {}
    for name, g in ref.items():
        model = name.split(".", 1)[0]
        largest[model] = max(largest.get(model, 0.0), g.norm().item())
    errs = {}
    for name, g in ref.items():
        scale = max(g.norm().item(), SCALE_FLOOR * largest[name.split(".", 1)[0]])
        err = (got[name] - g).norm().item()
        errs[name] = err / scale if scale > 0 else err
    return errs


class Reference:
    """The one-process run of a case: models before any backward, inputs, outputs and gradients."""

    def __init__(self, case: TinyCase, tokens: int, text_tokens: int | None = None, *, ckpt: bool = False) -> None:
        self.case = case
        self.models = build(case)
        self.pristine = copy.deepcopy(self.models)
        # with checkpointing on both sides: a model's checkpointed path may differ from its plain one
        # (diffusers 0.42.1 Chroma drops the mask in checkpointed single blocks)
        self.ckpt = ckpt
        for model in self.models if ckpt and getattr(self.models[0], "_supports_gradient_checkpointing", True) else ():
            model.enable_gradient_checkpointing(checkpoint)  # (Sana-WM's refiner has none: its rows run plain)
        self.inputs = make_inputs(case, self.models, tokens, text_tokens)
        self.outs = forward_backward(self.models, self.inputs)
        self.grads = grads(self.models)
        # parameters no input reaches: a fault of the case (or its `unused` list) unless declared
        self.silent = sorted(
            n
            for n, g in self.grads.items()
            if not g.any() and not any(n.split(".", 1)[1].startswith(u) for u in case.unused)
        )


def run_cp(ref: Reference, mesh, ring: int, *, plan: Mapping | None = None) -> dict:
    """One CP run of ``ref``'s case on ``mesh`` (checkpointed when the reference is): errors against the
    reference, the same on every rank."""
    from cp_lightning import parallelize, remove
    from cp_lightning.mesh import CP, cp_groups

    models = copy.deepcopy(ref.pristine)
    for model in models:
        if ref.ckpt and getattr(model, "_supports_gradient_checkpointing", True):
            model.enable_gradient_checkpointing(checkpoint)
        parallelize(model, mesh=mesh, ring=ring, plan=plan)
    try:
        outs = forward_backward(models, ref.inputs)
    finally:
        for model in models:
            remove(model)
    got = grads(models)
    group = cp_groups(mesh, ring).cp if mesh.ndim > 1 else mesh[CP].get_group()
    # SUM over the CP group must equal the one-process gradient: one flat all-reduce, not one per tensor
    flat = torch.cat([g.flatten() for g in got.values()])
    dist.all_reduce(flat, group=group)
    for g, summed in zip(got.values(), flat.split([g.numel() for g in got.values()]), strict=True):
        g.copy_(summed.view_as(g))
    errs = grad_errors(got, ref.grads)
    worst = max(errs, key=errs.get)
    if [o.shape for o in outs] != [r.shape for r in ref.outs]:
        return {
            "out_err": float("inf"),
            "grad_err": float("inf"),
            "worst": "",
            "silent": [],
            "error": f"output shapes {[tuple(o.shape) for o in outs]} under CP, {[tuple(r.shape) for r in ref.outs]} "
            "in one process: the plan splits or gathers the wrong dim, or does not gather the output",
        }
    out_err = max((o - r).abs().max().item() for o, r in zip(outs, ref.outs, strict=True))
    return {
        "out_err": out_err,
        "grad_err": errs[worst],
        "worst": worst,
        "silent": ref.silent,
    }


def passed(row: Mapping) -> bool:
    return row["out_err"] <= OUT_TOL and row["grad_err"] <= GRAD_TOL and not row["silent"]


def modes(cp: int, ring: int | None) -> list[tuple[str, int]]:
    """(mode name, ring degree) for the checker's table: Ulysses, ring and, when cp allows it, USP."""
    if ring is not None and (ring < 1 or cp % ring):
        raise ValueError(f"--ring {ring} must divide --cp {cp} (cp = ring x ulysses).")
    out = [("ulysses", 1), ("ring", cp)] if cp > 1 else [("ulysses", 1)]
    usp = ring if ring is not None else next((r for r in range(2, cp) if cp % r == 0), None)
    if usp is not None and 1 < usp < cp:
        out.append((f"usp ring{usp}xulysses{cp // usp}", usp))
    return out


# ---------------------------------------------------------------- worker processes


def _worker(rank, world, port, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException as err:  # noqa: BLE001 - the parent reports it
        results.put((rank, False, f"{type(err).__name__}: {err}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn, world: int, *args, timeout_s: float = 900.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo CPU processes; results by rank (raises on failure)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    try:
        while len(out) < world:
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"the check did not finish within {timeout_s:.0f}s") from None
            if not ok:
                raise RuntimeError(f"rank {rank}: {value}")
            out[rank] = value
        return [out[r] for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
