"""``python -m cp_lightning.plan``: the planner's command line (Markdown table or ``--json``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from cp_lightning.planner.architectures import CONFIGS, resolve_model
from cp_lightning.planner.memory import BYTES, GIB, Estimate, Hardware, Layout, Training
from cp_lightning.planner.search import nothing_fits, search
from cp_lightning.planner.traffic import INTERCONNECTS, link_gbps

PRECISIONS = ("bf16-mixed", "bf16-true", "32-true")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cp_lightning.plan",
        description="Plan a context-parallel training layout: memory per GPU, traffic per step, relative time.",
    )
    p.add_argument("--model", help=f"built-in ({', '.join(sorted(CONFIGS))}) or a diffusers config.json")
    p.add_argument("--gpus", type=int, help="GPUs in all (default: the recipe's devices x num_nodes)")
    p.add_argument("--gpu-memory", type=float, required=True, help="memory per GPU in GiB")
    p.add_argument("--nodes", type=int, default=None, help="nodes the GPUs are spread over (default 1)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--tokens", type=int, nargs="+", help="tokens one sample puts through attention, per bucket")
    src.add_argument("--config", help="a recipe YAML: model, buckets (scan of data_dir) and layout")
    p.add_argument(
        "--search",
        action="store_true",
        help="with --config: search every layout for the recipe's model and buckets instead of evaluating its own",
    )
    p.add_argument("--batch", type=int, default=None, help="samples per dp rank (default 1)")
    p.add_argument("--text-tokens", type=int, default=None, help="text tokens per sample (default: the family's)")
    p.add_argument("--lora-rank", type=int, default=None, help="LoRA rank; 0 (default) trains every weight")
    p.add_argument("--ema", action="store_true", help="keep an EMA copy of the trainable weights")
    p.add_argument("--fsdp", choices=("auto", "on", "off"), default=None)
    p.add_argument("--checkpointing", choices=("auto", "on", "off"), default=None)
    p.add_argument("--dp", type=int)
    p.add_argument("--cp", type=int)
    p.add_argument("--ring", type=int, default=None)
    p.add_argument("--hsdp", action="store_true", help="with --dp/--cp and FSDP: shard inside CP groups")
    p.add_argument("--offload", action="store_true", help="with --dp/--cp and checkpointing: offload activations")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16-mixed")
    p.add_argument("--params-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--base-dtype", choices=("bfloat16", "float32", "float8_e4m3fn"), default=None)
    p.add_argument(
        "--interconnect",
        nargs="+",
        metavar="LINK",
        help="the link between the GPUs of a node and, optionally, a second one between nodes: "
        + ", ".join(f"{k} ({v:g})" for k, v in INTERCONNECTS.items())
        + " or GB/s per GPU and direction (default: nvlink ib; traffic.py says what each assumes)",
    )
    p.add_argument(
        "--tflops",
        type=float,
        default=None,
        help="effective bf16 TFLOP/s per GPU for the relative time (default 400: H100; 66: RTX 4090)",
    )
    p.add_argument("--top", type=int, default=8, help="layouts in the table")
    p.add_argument("--json", action="store_true", help="print the chosen layout and gib_per_gpu as JSON")
    return p


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def _bytes(x: float) -> str:
    return f"{x / 1e9:.2f} GB" if x >= 1e8 else f"{x / 1e6:.1f} MB"


def table(estimates: list[Estimate], top: int) -> str:
    best = min((e.sample_seconds for e in estimates if e.fits), default=None)
    head = (
        "| layout | states | FSDP in-flight | activations | CP buffers | fixed + margin | GiB/GPU | bytes/step "
        "| rel. time/sample | fits |"
    )
    lines = [head, "|" + "---|" * 10]
    for e in estimates[:top]:
        comm = ", ".join(f"{k} {_bytes(v)}" for k, v in e.comm.items()) or "-"
        rel = f"{e.sample_seconds / best:.2f}" if best else "-"
        cells = [e.layout.describe(), _gib(e.states), _gib(e.fsdp_in_flight), _gib(e.activations), _gib(e.cp_buffers),
                 _gib(e.fixed + e.margin), _gib(e.total), comm, rel, "yes" if e.fits else "no"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def links(interconnect: Sequence[str] | None, tflops: float | None) -> dict:
    """Hardware's link and throughput fields from ``--interconnect INTRA [INTER]`` and ``--tflops``."""
    out = {}
    if interconnect:
        if len(interconnect) > 2:
            raise ValueError(
                f"--interconnect takes the link inside a node and optionally the one between nodes, got "
                f"{len(interconnect)} values: {' '.join(interconnect)}."
            )
        out["intra_node_gbps"] = link_gbps(interconnect[0])
        if len(interconnect) == 2:
            out["inter_node_gbps"] = link_gbps(interconnect[1], what="--interconnect (between nodes)")
    if tflops is not None:
        out["tflops"] = tflops
    return out


def run(argv: Sequence[str] | None = None) -> tuple[dict, str]:
    """(the JSON result, the Markdown report) for the command line ``argv``; ValueError on bad input."""
    a = parser().parse_args(argv)
    recipe = None
    if a.config:
        from cp_lightning.planner.recipe import read_recipe

        recipe = read_recipe(a.config, a.model)
    elif a.search:
        raise ValueError("--search plans a recipe's model and buckets: give --config RECIPE.yaml (without it the "
                         "planner searches already, from --model and --tokens).")  # fmt: skip
    elif not a.model:
        raise ValueError("give --model NAME_OR_CONFIG (with --tokens) or --config RECIPE.yaml.")
    elif not a.tokens:
        raise ValueError("give --tokens T [T ...] (tokens per sample, one per bucket) or --config RECIPE.yaml.")
    spec = resolve_model(recipe.model if recipe else a.model)
    gpus = a.gpus if a.gpus is not None else (recipe.gpus if recipe else None)
    if gpus is None:
        raise ValueError("give --gpus N (GPUs in all).")
    nodes = a.nodes if a.nodes is not None else (recipe.nodes if recipe and recipe.gpus == gpus else 1)
    lora = a.lora_rank if a.lora_rank is not None else (recipe.lora_rank if recipe else 0)
    if lora < 0:
        raise ValueError(f"--lora-rank must be >= 0 (0: full fine-tune), got {lora}.")
    ema = a.ema or bool(recipe and recipe.ema)
    training = Training(lora_rank=lora, params_dtype=a.params_dtype, precision=a.precision, ema=ema)
    own = recipe is not None and not a.search and isinstance(recipe.cp, int) and a.cp is None and a.dp is None
    own = own and a.fsdp is None  # evaluate the recipe's own layout (else search, or the --dp/--cp given)
    base = a.base_dtype
    if base is None and recipe is not None and lora and not a.search:
        base = recipe.base_dtype or recipe.weights_dtype
    if base is not None and base not in BYTES:
        raise ValueError(f"--base-dtype {base!r}: use bfloat16, float32 or float8_e4m3fn.")
    if base is not None and base.startswith("float8") and not lora:
        raise ValueError("--base-dtype float8_e4m3fn stores a frozen base: it needs --lora-rank > 0.")
    tokens = a.tokens or recipe.tokens
    batch = a.batch if a.batch is not None else (recipe.batch if recipe else 1)
    text = a.text_tokens if a.text_tokens is not None else (recipe.text_tokens if recipe else None)
    fsdp = a.fsdp or "auto"
    ckpt = a.checkpointing or "auto"
    cp, dp, ring = a.cp, a.dp, a.ring
    if own:
        cp, ring = recipe.cp, ring or recipe.ring  # the recipe's own layout
        fsdp = "on" if recipe.fsdp == "on" else "off"
        ckpt = ckpt if a.checkpointing else ("on" if recipe.checkpointing else "off")
    layout = None
    if cp is not None or dp is not None:
        if cp is None or dp is None:
            cp = cp if cp is not None else gpus // dp
            dp = dp if dp is not None else gpus // max(cp, 1)
        if fsdp == "auto" or ckpt == "auto":
            raise ValueError("with --dp/--cp give --fsdp on|off and --checkpointing on|off too (the layout in full).")
        sharding = ("hsdp" if a.hsdp or (recipe and recipe.hsdp) else "full") if fsdp == "on" else "off"
        offload = a.offload or (own and recipe.offload)
        layout = Layout(dp, cp, ring or 1, sharding, ckpt == "on", offload, base or "bfloat16", batch)
    hw = Hardware(gpus=gpus, gpu_memory_gib=a.gpu_memory, nodes=nodes, **links(a.interconnect, a.tflops))
    estimates = search(spec, hw, training, tokens, batch=batch, text_tokens=text, fsdp=fsdp, checkpointing=ckpt,
                       base_dtype=base, layout=layout)  # fmt: skip
    chosen = estimates[0]
    result = chosen.as_dict()
    result.update(model=spec.name, tokens=tokens, fits=chosen.fits)
    result["interconnect_gbps"] = {"intra_node": hw.intra_node_gbps, "inter_node": hw.inter_node_gbps}
    if not chosen.fits:
        result["why"] = nothing_fits(estimates, hw)
    what = "full fine-tune" if not lora else f"LoRA rank {lora}"
    title = (f"{spec.name}, {what}, {gpus} x {a.gpu_memory:g} GiB GPUs, largest sample {max(tokens)} tokens, "
             f"batch {batch} per dp rank, links {hw.intra_node_gbps:g} GB/s inside a node"
             + (f", {hw.inter_node_gbps:g} GB/s between nodes" if nodes > 1 else "")
             + " per GPU and direction")  # fmt: skip
    report = [f"## {title}", ""]
    if recipe is not None and recipe.note:
        report += [f"Buckets: {recipe.note}.", ""]
    report += [table(estimates, a.top), ""]
    chosen_line = f"Chosen: {chosen.layout.describe()}: {chosen.gib_per_gpu:.1f} GiB per GPU."
    report.append(chosen_line if chosen.fits else result["why"])
    return result, "\n".join(report)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        result, report = run(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if "--json" in (argv if argv is not None else sys.argv[1:]) else report)
    return 0 if result["fits"] else 1
