"""Plan checker: ``python -m cp_lightning.check CLASS_OR_CONFIG [--cp N --ring R --plan module:attr]``, or ``--all``.

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
import inspect
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from torch import nn

from cp_lightning.models import CASES, TinyCase

# the comparison itself lives in cp_lightning.parity; its names stay importable from here
from cp_lightning.parity import (  # noqa: F401
    GRAD_TOL,
    OUT_TOL,
    SCALE_FLOOR,
    Reference,
    _wake,
    build,
    forward_backward,
    grad_errors,
    grads,
    load_attr,
    make_inputs,
    modes,
    passed,
    rel_err,
    run_cp,
    run_workers,
)

# ---------------------------------------------------------------- resolving cases


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


# ---------------------------------------------------------------- the command line


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
    from cp_lightning import check_all

    parser = argparse.ArgumentParser(prog="python -m cp_lightning.check", description=__doc__.split("\n\n")[1])
    parser.add_argument(
        "model", metavar="CLASS_OR_CONFIG", nargs="?", help="tiny case, diffusers class, config.json, or module:Class"
    )
    parser.add_argument("--config", default=None, help="with module:Class: a JSON file of the class's arguments")
    parser.add_argument("--inputs", default=None, help="with module:Class: module:function building the inputs")
    parser.add_argument("--cp", type=int, default=2, help="CP degree = number of gloo processes (default 2)")
    parser.add_argument("--ring", type=int, default=None, help="ring degree of the USP row (default: smallest)")
    parser.add_argument("--plan", default=None, help="module:attr of a plan dict to check instead of the default")
    parser.add_argument(
        "--tokens", type=int, default=None, help="video/image tokens (default: the case's own, else 4*cp+1, uneven)"
    )
    parser.add_argument("--checkpointing", action="store_true", help="also run each mode with checkpointing")
    check_all.add_arguments(parser)
    args = parser.parse_args(argv)
    if (code := check_all.main(args)) is not None:  # --all, or a class the library refuses whole
        return code
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
    tokens = args.tokens or case.tokens or 4 * args.cp + 1
    if custom:  # workers rebuild the case: the config as read here, the references as given
        spec = {"_custom": args.model, "config": case.config, "inputs": args.inputs}
    else:
        spec = args.model if case.name in CASES else dict(case.config, _class_name=case.cls)
    rows = run_workers(_check_worker, args.cp, spec, tokens, mode_list, args.plan, args.checkpointing)[0]
    print(table(rows, case, args.cp, tokens))
    return 0 if all(passed(row) for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
