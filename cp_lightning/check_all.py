"""The checker over the whole plan library: ``python -m cp_lightning.check --all [--cp N] [--checkpointing]``.

Runs every tiny case of the library (``cp_lightning.models.CASES``) in one group of ``cp`` gloo CPU processes,
each mode of :func:`cp_lightning.parity.modes` against the one-process :class:`~cp_lightning.parity.Reference`,
and prints one Markdown row per diffusers class the library knows (``CASES`` and ``PLANS``): exact, refused
(with the reason its entry gives) or failing, with the worst output and gradient errors over its cases and
modes. Exits 0 when no class fails, 1 when one does, 2 on bad usage.

``python -m cp_lightning.check CLASS`` for a class the library refuses whole (OmniGen, AnyFlow-FAR, ...), which
has no tiny case to build, prints the refusal and exits 0: the refusal is the library's documented answer.

:func:`docs_table` renders docs/models.md's generated table (class, cases, plan source, result, notes) from the
same metadata and the parity rows of tests/test_library.py, which keeps the file equal to it. It holds no
error figures, so it reads the same on every machine.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from cp_lightning.models import CASES, DIFFUSERS, PLANS
from cp_lightning.parity import GRAD_TOL, OUT_TOL, SCALE_FLOOR, modes, passed, run_workers

BEGIN = "<!-- begin generated table: cp_lightning.check_all.docs_table; tests/test_library.py keeps it equal -->"
END = "<!-- end generated table -->"


# ---------------------------------------------------------------- the library's metadata


def classes() -> list[str]:
    """Every diffusers class the library knows, in registration order (family by family)."""
    return list(dict.fromkeys([*PLANS, *(case.cls for case in CASES.values())]))


def cases_of(cls: str) -> list[str]:
    return [name for name, case in CASES.items() if case.cls == cls]


def refusal(cls: str) -> str | None:
    """Why the library refuses every instance of ``cls`` (an entry without a plan), else None."""
    entry = PLANS.get(cls)
    if entry is None or entry.plan is not None:
        return None
    import diffusers

    klass = getattr(diffusers, cls)
    return entry.refuse(klass.__new__(klass))  # whole-class refusals read no config: no instance is built


def plan_source(cls: str) -> str:
    import diffusers

    entry = PLANS.get(cls)
    if entry is not None and entry.plan is None:
        return "none"
    if entry is None or entry.plan == DIFFUSERS:
        return "diffusers"
    return "ours (corrected)" if getattr(getattr(diffusers, cls, None), "_cp_plan", None) else "ours"


# ---------------------------------------------------------------- verdicts


def _row_ok(row: Mapping) -> bool:
    return "error" not in row and passed(row)


def _why(row: Mapping) -> str:
    if "error" in row:
        return row["error"]
    if row["silent"]:
        return f"no gradient reaches {', '.join(row['silent'][:3])}"
    if not row["out_err"] <= OUT_TOL:
        return f"output error {row['out_err']:.2e} over the tolerance {OUT_TOL:g}"
    return f"gradient error {row['grad_err']:.2e} over the tolerance {GRAD_TOL:g} ({row['worst']})"


def verdict(cls: str, case_rows: Mapping[str, Sequence[Mapping]]) -> dict:
    """One class's result over its cases' rows (``case name -> [row of run_cp, with "mode"]``): ``result`` is
    "refused", "exact", "failing" or "not run" (a case without rows); ``why`` the refusal or first failure."""
    reason = refusal(cls)
    if reason is not None:
        return {"result": "refused", "why": reason}
    names = cases_of(cls)
    if not names:
        return {"result": "failing", "why": "no tiny case in the library"}
    if any(not case_rows.get(name) for name in names):
        return {"result": "not run", "why": ""}
    rows = [(name, row) for name in names for row in case_rows[name]]
    out = {"result": "exact", "why": ""}
    if any("error" not in row for _, row in rows):  # figures only where a row measured any
        out.update(out_err=0.0, grad_err=0.0, worst="")
    for name, row in rows:
        if "error" not in row and math.isfinite(row["out_err"]):
            out["out_err"] = max(out["out_err"], row["out_err"])
        if "error" not in row and math.isfinite(row["grad_err"]) and row["grad_err"] >= out["grad_err"]:
            where = f"{name} {row['mode']}" if "mode" in row else name
            out["grad_err"], out["worst"] = row["grad_err"], f"{where}: {row['worst']}"
    failing = [(name, row) for name, row in rows if not _row_ok(row)]
    if failing:
        name, row = failing[0]
        mode = f" {row['mode']}" if "mode" in row else ""
        out.update(result="failing", why=f"`{name}`{mode}: {_why(row)}")
    return out


def counts(verdicts: Mapping[str, Mapping]) -> str:
    results = [v["result"] for v in verdicts.values()]
    line = f"{results.count('exact')} exact, {results.count('refused')} refused, {len(results)} classes in all"
    others = len(results) - results.count("exact") - results.count("refused")
    return line + (f" ({others} failing or not run)" if others else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------- docs/models.md


def docs_table(case_rows: Mapping[str, Sequence[Mapping]]) -> str:
    """docs/models.md's generated region: one row per class (no error figures), and the counts."""
    verdicts = {cls: verdict(cls, case_rows) for cls in classes()}
    lines = [
        BEGIN,
        "",
        f"**{counts(verdicts)}.**",
        "",
        "| diffusers class | tiny cases | plan | result | notes |",
        "|---|---|---|---|---|",
    ]
    for cls, v in verdicts.items():
        names = cases_of(cls)
        # a failure's text holds error figures: the docs name the result only (the test prints the rest)
        result = v["result"] + (f": {v['why']}" if v["result"] == "refused" else "")
        notes = [f"`{name}`: {CASES[name].note}" for name in names if CASES[name].note]
        entry = PLANS.get(cls)
        if entry is not None and entry.loss_parallel:
            notes.append(f"`loss_parallel` refused: {entry.loss_parallel}")
        cases = ", ".join(f"`{name}`" for name in names)
        lines.append(f"| `{cls}` | {cases} | {plan_source(cls)} | {_cell(result)} | {_cell('; '.join(notes))} |")
    return "\n".join([*lines, "", END])


def docs_region(text: str) -> str:
    """The generated region of a docs file, markers included (ValueError when the markers are missing)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no generated region: the file lacks the markers {BEGIN!r} ... {END!r}")
    return text[start : end + len(END)]


def write_docs(path: str | Path, table: str) -> None:
    path = Path(path)
    text = path.read_text()
    path.write_text(text.replace(docs_region(text), table))


# ---------------------------------------------------------------- the command line


def _all_worker(rank, world, names, tokens, mode_list, ckpt):
    from cp_lightning import build_mesh
    from cp_lightning.parity import Reference, run_cp

    mesh = build_mesh(world)
    out = {}
    for i, name in enumerate(names):
        if rank == 0:
            print(f"[{i + 1}/{len(names)}] {name}", file=sys.stderr, flush=True)
        rows = out[name] = []
        try:  # a case that cannot be built fails alike on every rank, before any collective
            count = CASES[name].tokens or tokens  # a case whose model takes only some counts brings its own
            refs = {use: Reference(CASES[name], count, ckpt=use) for use in ((False, True) if ckpt else (False,))}
        except Exception as err:  # noqa: BLE001 - one failing row of the table
            rows.append({"mode": "build", "error": f"crashed building the case ({type(err).__name__}): {err}"})
            continue
        for mode, ring in mode_list:
            for use, ref in refs.items():
                try:
                    row = run_cp(ref, mesh, ring)
                except Exception as err:  # noqa: BLE001 - a refusal (ValueError) or a crash is one row
                    kind = "refused" if isinstance(err, ValueError) else f"crashed ({type(err).__name__})"
                    row = {"error": f"{kind}: {err}"}
                rows.append({"mode": mode + (" +ckpt" if use else ""), **row})
    return out


def run_all(cp: int, tokens: int, mode_list, ckpt: bool) -> dict[str, list[dict]]:
    """Every library case's rows, ``case name -> [row]``, from one group of ``cp`` worker processes."""
    names = list(CASES)
    return run_workers(_all_worker, cp, names, tokens, mode_list, ckpt, timeout_s=120.0 * len(names))[0]


def table(case_rows: Mapping[str, Sequence[Mapping]], cp: int, tokens: int, mode_list, ckpt: bool) -> str:
    verdicts = {cls: verdict(cls, case_rows) for cls in classes()}
    mode_names = ", ".join(name for name, _ in mode_list) + (", each with and without checkpointing" if ckpt else "")
    lines = [
        f"every library case, cp={cp} ({mode_names}), {tokens} tokens, fp32; tolerances: output {OUT_TOL:g}, "
        f"grad {GRAD_TOL:g} (L2, of max(the tensor's gradient, {SCALE_FLOOR:g} x the model's largest))",
        "",
        "| diffusers class | tiny cases | result | output max abs err | grad max rel err "
        "| worst gradient (case mode: parameter) |",
        "|---|---|---|---|---|---|",
    ]
    for cls, v in verdicts.items():
        cases = ", ".join(cases_of(cls))
        result = v["result"] + (f": {v['why']}" if v["why"] else "")
        errs = f"{v['out_err']:.2e} | {v['grad_err']:.2e} | {v['worst']}" if "out_err" in v else " |  | "
        lines.append(f"| {cls} | {cases} | {_cell(result)} | {errs} |")
    return "\n".join([*lines, "", counts(verdicts)])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--all", action="store_true", help="check every library case: one row per diffusers class")
    parser.add_argument("--write-docs", metavar="PATH", help="with --all: rewrite PATH's generated table (models.md)")


def main(args: argparse.Namespace) -> int | None:
    """The checker's answer to ``--all`` or to a class refused whole; None for every other command line."""
    if args.all:
        if args.model or args.plan or args.config or args.inputs:
            print(
                "error: --all checks every library case with its library plan; it takes no CLASS_OR_CONFIG, "
                "--plan, --config or --inputs.",
                file=sys.stderr,
            )
            return 2
        try:
            if args.cp < 1:
                raise ValueError(f"--cp must be >= 1, got {args.cp}.")
            mode_list = modes(args.cp, args.ring)
            if args.write_docs:  # before the run, not after it
                docs_region(Path(args.write_docs).read_text())
        except (ValueError, OSError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        tokens = args.tokens or 4 * args.cp + 1
        case_rows = run_all(args.cp, tokens, mode_list, args.checkpointing)
        print(table(case_rows, args.cp, tokens, mode_list, args.checkpointing))
        if args.write_docs:
            write_docs(args.write_docs, docs_table(case_rows))
        return 1 if any(verdict(cls, case_rows)["result"] != "exact" for cls in classes() if not refusal(cls)) else 0
    if args.write_docs:
        print("error: --write-docs goes with --all.", file=sys.stderr)
        return 2
    if args.model is None:
        print("error: name a CLASS_OR_CONFIG to check, or pass --all.", file=sys.stderr)
        return 2
    reason = refusal(args.model) if not cases_of(args.model) else None
    if reason is not None:
        print(
            f"{args.model}: refused by cp_lightning's plan library (parallelize raises a ValueError with this reason "
            f"before any communication), so there is nothing to check: {reason}"
        )
        return 0
    return None
