"""Plan checker: ``python -m cp_lightning.check CLASS_OR_CONFIG [--cp N --ring R --plan module:attr]``.

For a model outside the library: ``python -m cp_lightning.check module:Class --config CONFIG.json
--inputs module:function [--plan module:attr]`` builds ``Class(**config)`` and checks it the same way.

Builds a tiny random-init instance of a diffusers transformer (the plan library's scaled-down config;
parameters initialised to zero, such as gates and output layers, given random values so that every
path carries a gradient), runs forward and backward under context parallelism on ``cp`` gloo CPU
processes and in one process, and prints a Markdown table of the output error and the CP-summed
gradient error per mode (Ulysses, ring, USP). Exits 1 when any mode misses the fp32 tolerances
(outputs 1e-5 absolute; gradients 1e-4 in L2 norm of the larger of the tensor's own gradient and
1e-4 x the model's largest gradient, see :func:`grad_errors`) or a parameter gets no gradient, 2 on bad usage.

``CLASS_OR_CONFIG`` is a tiny case of the library (``wan2.2-ti2v``), a diffusers class name
(``WanVACETransformer3DModel``: its first case), or a diffusers ``config.json`` (or a folder holding
one) whose ``_class_name`` the library knows: its architecture switches (booleans, strings, ``None``s)
replace the tiny config's, while sizes stay tiny. ``--plan module:attr`` checks your own plan
instead of the default (:func:`cp_lightning.models.plan_for`, which also finds a ``_cp_plan`` class
attribute). ``module:Class`` is any ``nn.Module`` class; ``--inputs`` names a function
``inputs(model, generator, batch, tokens, text_tokens, dtype)`` returning the forward's keyword
arguments for ``tokens`` sequence tokens (full inputs, the same on every rank; a TinyCase's ``inputs``),
and ``--config`` a JSON file of the class's keyword arguments (small sizes: the checker runs them on CPU).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import json
import multiprocessing as mp
import os
import queue
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from cp_lightning.models import CASES, TinyCase
from cp_lightning.tiny import checkpoint, construct

OUT_TOL = 1e-5
GRAD_TOL = 1e-4


# ---------------------------------------------------------------- building cases


def resolve_case(name_or_config: str | Mapping) -> TinyCase:
    """A :class:`TinyCase` from a case name, a diffusers class name, a config dict or a config path."""
    if isinstance(name_or_config, Mapping):
        if "_custom" in name_or_config:
            spec = name_or_config
            return custom_case(spec["_custom"], spec["config"], spec["inputs"])
        return _case_from_config(dict(name_or_config), "<config>")
    if name_or_config in CASES:
        return CASES[name_or_config]
    by_class = [case for case in CASES.values() if case.cls == name_or_config]
    if by_class:
        return by_class[0]
    path = Path(name_or_config)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.is_file():
        return _case_from_config(json.loads(path.read_text()), str(path))
    known = sorted({case.cls for case in CASES.values()})
    raise ValueError(
        f"{name_or_config!r} is neither a tiny case ({', '.join(sorted(CASES))}), a class with one "
        f"({', '.join(known)}) nor a diffusers config.json. To check another model, add a TinyCase (tiny config "
        "and inputs) to a module of cp_lightning/models/ (see docs/models.md)."
    )


def custom_case(cls_ref: str, config: Mapping | str, inputs_ref: str) -> TinyCase:
    """A :class:`TinyCase` for a model outside the library: ``module:Class``, its config (a dict or the path of
    a JSON file) and ``module:function`` building its inputs. Raises ValueError/ImportError when one is wrong."""
    if isinstance(config, str):
        path = Path(config)
        if not path.is_file():
            raise ValueError(f"--config {config!r}: no such file (a JSON object of {cls_ref}'s keyword arguments).")
        config = json.loads(path.read_text())
    if not isinstance(config, Mapping):
        raise ValueError(f"--config must hold a JSON object of {cls_ref}'s keyword arguments, got {config!r}.")
    cls = load_attr(cls_ref, "model")
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"{cls_ref!r} is not an nn.Module class.")
    inputs = load_attr(inputs_ref, "--inputs")
    if not callable(inputs):
        raise ValueError(f"--inputs {inputs_ref!r} is not a function.")
    return TinyCase(cls.__name__, cls_ref, dict(config), inputs)


def _model_class(name: str) -> type:
    """A library case's diffusers class by name, or a custom case's ``module:Class``."""
    if ":" in name:
        return load_attr(name, "model")
    import diffusers

    return getattr(diffusers, name)


def _case_from_config(config: dict, where: str) -> TinyCase:
    cls = config.get("_class_name")
    base = [case for case in CASES.values() if case.cls == cls]
    if not base:
        raise ValueError(
            f"{where}: _class_name {cls!r} has no tiny case in cp_lightning's library, so the checker cannot scale it "
            "down; known classes: " + ", ".join(sorted({case.cls for case in CASES.values()}))
        )
    case = base[0]
    tiny = dict(case.config)
    # architecture switches come from the user's config; sizes (ints, floats, size tuples) stay tiny
    for key, value in config.items():
        if not key.startswith("_") and _is_switch(value) and key in _init_args(cls):
            tiny[key] = value
    return replace(case, name=f"{case.name}@{Path(where).parent.name or where}", config=tiny)


def _is_switch(value) -> bool:
    return value is None or isinstance(value, (bool, str))


def _init_args(cls_name: str) -> set[str]:
    import diffusers

    return set(inspect.signature(getattr(diffusers, cls_name).__init__).parameters)


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


# ---------------------------------------------------------------- the command line


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


def _check_worker(rank, world, spec, tokens, mode_list, plan_ref, ckpt):
    from cp_lightning import build_mesh

    case = resolve_case(spec)  # cases hold functions, so workers rebuild them from the spec
    plan = load_attr(plan_ref) if plan_ref else None
    refs = {use_ckpt: Reference(case, tokens, ckpt=use_ckpt) for use_ckpt in ((False, True) if ckpt else (False,))}
    mesh = build_mesh(world)
    rows = []
    for name, ring in mode_list:
        for use_ckpt, ref in refs.items():
            try:
                row = run_cp(ref, mesh, ring, plan=plan)
            except Exception as err:  # noqa: BLE001 - a refusal (ValueError) or a crash is one row of the table
                kind = "refused" if isinstance(err, ValueError) else f"crashed ({type(err).__name__})"
                row = {"out_err": float("nan"), "grad_err": float("nan"), "worst": "", "silent": [], "error": kind}
                row["error"] = f"{kind}: {err}"
            rows.append({"mode": name + (" +ckpt" if use_ckpt else ""), **row})
    return rows


def load_attr(ref: str, what: str = "--plan"):
    """The object ``module:attr`` names (``what``: the option, for the error)."""
    module, _, attr = ref.partition(":")
    if not module or not attr:
        raise ValueError(f"{what} takes module:attr (e.g. my_plans:WAN_PLAN), got {ref!r}.")
    try:
        return getattr(importlib.import_module(module), attr)
    except AttributeError:
        raise ValueError(f"{what} {ref!r}: module {module!r} has no attribute {attr!r}.") from None


def table(rows: Sequence[Mapping], case: TinyCase, cp: int, tokens: int) -> str:
    lines = [
        f"{case.name} ({case.cls}), cp={cp}, {tokens} tokens, fp32; tolerances: output {OUT_TOL:g}, "
        f"grad {GRAD_TOL:g} (L2, of max(the tensor's gradient, {SCALE_FLOOR:g} x the model's largest))",
        "",
        "| mode | output max abs err | grad max rel err (CP-summed, L2) | worst parameter | result |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            verdict = f"FAIL, {row['error']}"
        elif row["silent"]:
            verdict = f"FAIL: no gradient reaches {', '.join(row['silent'][:3])}"
        else:
            verdict = "ok" if passed(row) else "FAIL"
        lines.append(f"| {row['mode']} | {row['out_err']:.2e} | {row['grad_err']:.2e} | {row['worst']} | {verdict} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cp_lightning.check", description=__doc__.split("\n\n")[1])
    parser.add_argument(
        "model", metavar="CLASS_OR_CONFIG", help="tiny case, diffusers class name, config.json, or module:Class"
    )
    parser.add_argument("--config", default=None, help="with module:Class: a JSON file of the class's arguments")
    parser.add_argument("--inputs", default=None, help="with module:Class: module:function building the inputs")
    parser.add_argument("--cp", type=int, default=2, help="CP degree = number of gloo processes (default 2)")
    parser.add_argument("--ring", type=int, default=None, help="ring degree of the USP row (default: smallest)")
    parser.add_argument("--plan", default=None, help="module:attr of a plan dict to check instead of the default")
    parser.add_argument("--tokens", type=int, default=None, help="video/image tokens (default: 4*cp+1, uneven)")
    parser.add_argument("--checkpointing", action="store_true", help="also run each mode with checkpointing")
    args = parser.parse_args(argv)
    try:
        custom = ":" in args.model
        if (args.config is None or args.inputs is None) if custom else (args.config or args.inputs):
            raise ValueError(
                "a model outside the library is checked as `module:Class --config CONFIG.json --inputs module:function`"
                " (all three); a library case, class name or config.json takes neither --config nor --inputs."
            )
        case = custom_case(args.model, args.config, args.inputs) if custom else resolve_case(args.model)
        if args.cp < 1:
            raise ValueError(f"--cp must be >= 1, got {args.cp}.")
        mode_list = modes(args.cp, args.ring)
        if args.plan:
            load_attr(args.plan)
    except (ValueError, ImportError, AttributeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    tokens = args.tokens or 4 * args.cp + 1
    if custom:  # workers rebuild the case: the config as read here, the references as given
        spec = {"_custom": args.model, "config": case.config, "inputs": args.inputs}
    else:
        spec = args.model if case.name in CASES else dict(case.config, _class_name=case.cls)
    rows = run_workers(_check_worker, args.cp, spec, tokens, mode_list, args.plan, args.checkpointing)[0]
    print(table(rows, case, args.cp, tokens))
    return 0 if all(passed(row) for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
