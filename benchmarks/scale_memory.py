"""Loading and memory at scale: per-rank peak host memory of the Flux recipe on a >= 150M-parameter transformer.

    python benchmarks/scale_memory.py                          # world 2 and 4, every mode (about 15 min, 2 cores)
    python benchmarks/scale_memory.py --worlds 2 --modes ddp fsdp --params 160 --keep

The script writes its own diffusers pipeline folder once: the tiny Flux pipeline's text encoders, tokenizers,
VAE and scheduler (recipes/components.py) with its transformer replaced by a Flux-architecture one of at least
``--params`` million parameters, saved sharded (several safetensors files and the index json), in fp32 and, in a
second folder, in bf16. Then, for each world (cp 2, dp = world / 2) and mode, it runs
``python -m recipes.flux fit`` for 2 optimizer steps (batch 1 per dp rank, gradient checkpointing, one
one-step sample at the start and end, no checkpoints) and polls every rank's anonymous resident set.

What is measured: the peak of ``RssAnon`` (/proc/PID/status) of each rank process (the launched process is
rank 0, Lightning's launcher starts the others as its children), polled every ``--interval`` seconds, minus the
same peak of the same run with the tiny model (the baseline: Python, torch, Lightning, the data and the text
encoders), over the model's bytes in its training dtype (``weights_dtype``). Not VmHWM: safetensors maps the
files copy-on-write, so pages of a file read in its own dtype are shared file pages, not the rank's own memory.
The rank processes run with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc otherwise keeps freed blocks resident) and
with oneDNN's and ideep's caches of matmul plans capped at 16 entries (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``,
``LRU_CACHE_CAPACITY``; ``--onednn-caches default`` keeps their defaults of 1024): bf16 matmuls on CPU go through
oneDNN, which keeps one plan per distinct matmul shape, about 40 MiB in a bf16 run of this model (measured with
memray), memory a CUDA run does not hold on the host; fp32 matmuls use BLAS and keep none.
"frozen base" is the bytes of the frozen parameters and buffers the rank holds once training starts (local
shards under FSDP), over what the same parameters take in bf16 on that rank (whole model, or 1/world of it).

The ``-children`` modes shard with ``fsdp_units=children`` (one FSDP unit per part of each block, so a smaller
gather in flight); their baseline is the tiny model's FSDP run with the default units, like the other FSDP rows.
A mode whose recipe or strategy option this checkout lacks prints "n/a (option not available)".
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.rss import mem_info, run_polled  # noqa: E402

ROOT = common.ROOT
CP = 2
GiB = 2**30
ONEDNN_CACHE = "16"  # entries in oneDNN's and ideep's plan caches of the rank processes (default 1024 each)


@dataclass(frozen=True)
class Mode:
    """One row: the recipe config, which folder it reads and the options it adds."""

    label: str
    config: str  # configs/<config>.yaml
    files: str  # "fp32" or "bf16": which copy of the model folder
    weights_dtype: str
    # extra --model.* and --trainer.strategy.init_args.* options (checked for availability)
    options: tuple[str, ...] = field(default_factory=tuple)
    precision: str = "32-true"

    @property
    def fsdp(self) -> bool:
        return "fsdp" in self.config


BF16 = ("--model.weights_dtype=bfloat16",)
FP8 = ("--model.base_dtype=float8_e4m3fn",)
STRATEGY = "--trainer.strategy.init_args."
CHILDREN = (f"{STRATEGY}fsdp_units=children",)  # one FSDP unit per part of a block (attention, MLP, norm)
MODES = {
    "ddp": Mode("DDP LoRA, fp32", "tiny_flux_cp2", "fp32", "float32"),
    "ddp-bf16": Mode("DDP LoRA, bf16 from fp32 files", "tiny_flux_cp2", "fp32", "bfloat16", BF16, "bf16-mixed"),
    "ddp-fp8": Mode("DDP LoRA, fp8 base (bf16 files)", "tiny_flux_cp2", "bf16", "bfloat16", BF16 + FP8, "bf16-mixed"),
    "fsdp": Mode("FSDP LoRA, fp32", "tiny_flux_fsdp_cp2", "fp32", "float32"),
    "fsdp-fp8": Mode(
        "FSDP LoRA, fp8 base (bf16 files)", "tiny_flux_fsdp_cp2", "bf16", "bfloat16", BF16 + FP8, "bf16-mixed"
    ),
    "fsdp-children": Mode("FSDP LoRA, fp32, fsdp_units=children", "tiny_flux_fsdp_cp2", "fp32", "float32", CHILDREN),
    "fsdp-fp8-children": Mode(
        "FSDP LoRA, fp8 base, fsdp_units=children",
        "tiny_flux_fsdp_cp2",
        "bf16",
        "bfloat16",
        BF16 + FP8 + CHILDREN,
        "bf16-mixed",
    ),
    # not in the default run
    "ddp-bf16-files": Mode("DDP LoRA, bf16 from bf16 files", "tiny_flux_cp2", "bf16", "bfloat16", BF16, "bf16-mixed"),
}
DEFAULT_MODES = ("ddp", "ddp-bf16", "ddp-fp8", "fsdp", "fsdp-fp8", "fsdp-children", "fsdp-fp8-children")
NOT_AVAILABLE = "n/a (option not available)"


class HeldBytes(L.Callback):
    """Added to each measured run: at the start of training, every rank writes ``rank<N>.json`` into ``folder``
    with the bytes of frozen tensors (parameters that do not train, and buffers) and of trainable parameters it
    holds (local shards of DTensors)."""

    def __init__(self, folder: str):
        self.folder = Path(folder)
        self.loaded_anon = None

    def on_fit_start(self, trainer, pl_module):
        # after the strategy's set-up (loading, sharding, DDP wrapping), before any sample or training step;
        # loading only grows the process, so its current RssAnon is the loading peak
        from benchmarks.rss import rss_anon

        self.loaded_anon = rss_anon(os.getpid())

    def on_train_start(self, trainer, pl_module):
        def local(t) -> int:
            t = t.to_local() if hasattr(t, "to_local") else t
            return t.numel() * t.element_size()

        module = pl_module.transformer
        frozen = sum(local(p) for p in module.parameters() if not p.requires_grad)
        frozen += sum(local(b) for b in module.buffers())
        trainable = sum(local(p) for p in module.parameters() if p.requires_grad)
        self.folder.mkdir(parents=True, exist_ok=True)
        held = {"rank": trainer.global_rank, "frozen": frozen, "trainable": trainable, "loaded": self.loaded_anon}
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(held))


# ----- the model folder ---------------------------------------------------------------------------------------


def flux_config(params: float, hidden: int) -> dict:
    """A Flux transformer config with the tiny pipeline's text widths and latent channels (build_tiny_pipeline), and
    the fewest blocks (as many double- as single-stream) that reach ``params`` million parameters."""
    import torch
    from diffusers import FluxTransformer2DModel

    # Flux's head dim 128 where the heads still split evenly over cp, else 32
    head_dim = 128 if hidden % (128 * CP) == 0 else 32
    if hidden % (head_dim * CP):
        raise ValueError(f"--hidden must be a multiple of {32 * CP} (heads of 32 split over cp={CP}), got {hidden}.")
    rope = (head_dim // 8, 7 * head_dim // 16, 7 * head_dim // 16)
    base = dict(
        patch_size=1,
        in_channels=16,  # the tiny VAE's 4 latent channels, 2x2-packed
        attention_head_dim=head_dim,
        num_attention_heads=hidden // head_dim,
        joint_attention_dim=32,  # the tiny T5's width
        pooled_projection_dim=32,  # the tiny CLIP's projection
        axes_dims_rope=rope,
        guidance_embeds=True,
    )
    for layers in range(1, 200):
        config = {**base, "num_layers": layers, "num_single_layers": layers}
        with torch.device("meta"):
            count = sum(p.numel() for p in FluxTransformer2DModel(**config).parameters())
        if count >= params * 1e6:
            return {**config, "param_count": count}
    raise ValueError(f"--params {params} needs more than 199 blocks of width {hidden}: raise --hidden.")


def write_model_folders(out: Path, cache: Path, config: dict) -> dict[str, Path]:
    """The fp32 and bf16 pipeline folders (reused when they hold this config)."""
    import diffusers
    import torch
    from diffusers import FluxTransformer2DModel

    from recipes.components import resolve_pretrained

    tiny = Path(resolve_pretrained("flux", "tiny", cache))
    folders = {"fp32": out / "model_fp32", "bf16": out / "model_bf16"}
    stamp = json.dumps(config, sort_keys=True)
    if all(
        (f / "scale_memory.json").exists() and (f / "scale_memory.json").read_text() == stamp for f in folders.values()
    ):
        print(f"reusing the model folders in {out}", file=sys.stderr, flush=True)
        return folders
    arch = {k: v for k, v in config.items() if k != "param_count"}
    diffusers.utils.logging.set_verbosity_error()  # (its note on casting a model with no fp32-kept modules)
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**arch)
    for dtype, folder in folders.items():
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(tiny, folder, ignore=shutil.ignore_patterns("transformer"))
        model = model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
        nbytes = config["param_count"] * (2 if dtype == "bf16" else 4)
        shard = f"{math.ceil(nbytes / 4 / 2**20) + 1}MB"  # about 4 files, plus the index json
        model.save_pretrained(folder / "transformer", max_shard_size=shard, safe_serialization=True)
        (folder / "scale_memory.json").write_text(stamp)
        files = sorted(p.name for p in (folder / "transformer").glob("*.safetensors"))
        print(f"wrote {folder} ({dtype}, {len(files)} safetensors files)", file=sys.stderr, flush=True)
    return folders


# ----- runs ---------------------------------------------------------------------------------------------------


def model_options() -> set[str]:
    """The ``--model.*`` options this checkout's Flux recipe accepts, and its strategy's (``strategy.<name>``)."""
    from cp_lightning import ContextParallelStrategy
    from recipes.finetune import FlowMatchingFineTune
    from recipes.flux import FluxFineTune

    names = {n for cls in (FluxFineTune, FlowMatchingFineTune) for n in inspect.signature(cls.__init__).parameters}
    return names | {f"strategy.{n}" for n in inspect.signature(ContextParallelStrategy.__init__).parameters}


def available(mode: Mode, options: set[str]) -> bool:
    def name(opt: str) -> str:
        key = opt.split("=")[0]
        return f"strategy.{key.removeprefix(STRATEGY)}" if key.startswith(STRATEGY) else key.removeprefix("--model.")

    return all(name(opt) in options for opt in mode.options)


def recipe_command(
    mode: Mode, *, world: int, pretrained: str, run: Path, cache: Path, held: Path, lora_rank: int
) -> list[str]:
    callback = {"class_path": "benchmarks.scale_memory.HeldBytes", "init_args": {"folder": str(held)}}
    return [
        sys.executable,
        "-m",
        "recipes.flux",
        "fit",
        "--config",
        str(ROOT / "configs" / f"{mode.config}.yaml"),
        f"--model.pretrained={pretrained}",
        f"--trainer.devices={world}",
        f"--trainer.precision={mode.precision}",
        "--trainer.max_steps=2",
        "--trainer.logger=false",
        f"--trainer.default_root_dir={run}",
        f"--trainer.callbacks+={json.dumps(callback)}",
        f"--out_dir={run}",
        f"--model.cache_dir={cache}",
        "--model.gradient_checkpointing=true",
        f"--data.cache_dir={cache}",
        f"--data.data_dir={cache / 'shapes'}",
        "--data.pretrained=tiny",  # the same encoders as the model folders: one data cache for every run
        "--data.batch_size=1",
        f"--data.synthetic_samples={8 * world}",
        "--samples.num_inference_steps=1",
        "--samples.prompts=[a red circle]",
        "--checkpoint.every_n_steps=0",
        f"--model.lora_rank={lora_rank}",
        *mode.options,
    ]


def rank_env(onednn_caches: str = "capped") -> dict[str, str]:
    """The environment of the measured recipe runs (the module's docstring says why each setting)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["MALLOC_MMAP_THRESHOLD_"] = common.MMAP_THRESHOLD  # read by glibc at process start
    if onednn_caches == "capped":  # read at the first oneDNN matmul
        env.update(ONEDNN_PRIMITIVE_CACHE_CAPACITY=ONEDNN_CACHE, LRU_CACHE_CAPACITY=ONEDNN_CACHE)
    else:
        for key in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
            env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def measure(name: str, mode: Mode, *, world: int, pretrained: str, args) -> dict:
    run = args.out / "runs" / f"world{world}_{name}"
    shutil.rmtree(run, ignore_errors=True)
    held = run / "held"
    cmd = recipe_command(
        mode, world=world, pretrained=pretrained, run=run, cache=args.cache, held=held, lora_rank=args.lora_rank
    )
    print(f"world {world}: {name} ({mode.label}) ...", file=sys.stderr, flush=True)
    result = run_polled(
        cmd,
        env=rank_env(args.onednn_caches),
        cwd=ROOT,
        log=run / "log.txt",
        timeout=args.timeout,
        interval=args.interval,
    )
    result["held"] = {}
    for path in held.glob("rank*.json"):
        data = json.loads(path.read_text())
        result["held"][data["rank"]] = data
    if result["code"] != 0 or sorted(result["peaks"]) != list(range(world)):
        tail = (run / "log.txt").read_text()[-2000:]
        print(f"  FAILED ({result['code']}, ranks seen {sorted(result['peaks'])}); log {run / 'log.txt'}:\n{tail}")
        result["failed"] = True
    print(f"  {result['wall']:.0f} s", file=sys.stderr, flush=True)
    return result


# ----- output -------------------------------------------------------------------------------------------------


def rows_for_world(world: int, results: dict, baselines: dict, param_count: int) -> list[dict]:
    rows = []
    for key, result in results.items():
        mode = MODES[key]
        row = {"world": world, "mode": key, "label": mode.label, "files": mode.files}
        base = baselines.get("fsdp" if mode.fsdp else "ddp")
        if result is None or result.get("failed") or base.get("failed"):
            row["status"] = NOT_AVAILABLE if result is None else "failed (see the logs under OUT/runs)"
            rows.append(row)
            continue
        model_bytes = param_count * (2 if mode.weights_dtype == "bfloat16" else 4)
        above = [result["peaks"][r] - base["peaks"][r] for r in range(world)]
        bf16_per_rank = param_count * 2 / (world if mode.fsdp else 1)
        frozen = [result["held"].get(r, {}).get("frozen") for r in range(world)]
        row["trainable"] = [result["held"].get(r, {}).get("trainable") for r in range(world)]
        loaded = [result["held"].get(r, {}).get("loaded") for r in range(world)]
        base_loaded = [base["held"].get(r, {}).get("loaded") for r in range(world)]
        row["loaded_ratio"] = [
            (a - b) / model_bytes if a is not None and b is not None else None
            for a, b in zip(loaded, base_loaded, strict=True)
        ]
        row.update(
            status="ok",
            above=above,
            ratio=[a / model_bytes for a in above],
            frozen=frozen,
            frozen_vs_bf16=[f / bf16_per_rank if f is not None else None for f in frozen],
            target=f"<= {1 / world + 0.15:.2f}" if mode.fsdp else "<= 1.10",
            wall=result["wall"],
        )
        rows.append(row)
    return rows


def _per_rank(values, fmt: str) -> str:
    return " / ".join("-" if v is None else format(v, fmt) for v in values)


def render(world: int, rows: list[dict], param_count: int, baselines: dict, caches: str = "capped") -> str:
    headers = [
        "mode",
        "path",
        "files",
        "peak RssAnon above the tiny run, MiB (rank 0 / 1 / ...)",
        "x model in its training dtype",
        "target",
        "x model at training start (loaded)",
        "frozen base MiB/rank",
        "frozen base vs bf16",
        "wall s",
    ]
    body = []
    for r in rows:
        if r["status"] != "ok":
            body.append([r["mode"], r["label"], r["files"], r["status"], "", "", "", "", "", ""])
            continue
        body.append(
            [
                r["mode"],
                r["label"],
                r["files"],
                _per_rank([a / common.MiB for a in r["above"]], ".0f"),
                _per_rank(r["ratio"], ".2f"),
                r["target"],
                _per_rank(r["loaded_ratio"], ".2f"),
                _per_rank([f / common.MiB if f is not None else None for f in r["frozen"]], ".0f"),
                _per_rank(r["frozen_vs_bf16"], ".3f"),
                f"{r['wall']:.0f}",
            ]
        )
    base = "; ".join(
        f"{k}: {_per_rank([p / common.MiB for p in b['peaks'].values()], '.0f')} MiB" for k, b in baselines.items()
    )
    held = [r["trainable"][0] for r in rows if r["status"] == "ok" and r["trainable"][0] is not None]
    lora = f"LoRA {held[0] / common.MiB:.1f} MiB fp32 per rank (x4 with gradients and AdamW moments); " if held else ""
    note = (
        f"world {world} (cp {CP} x dp {world // CP}), {param_count / 1e6:.1f}M-parameter Flux transformer "
        f"({param_count * 4 / common.MiB:.0f} MiB fp32, {param_count * 2 / common.MiB:.0f} MiB bf16); "
        f"{lora}tiny-model baseline peak RssAnon per rank: {base}; oneDNN/ideep plan caches "
        f"{ONEDNN_CACHE + ' entries' if caches == 'capped' else 'at their defaults'}; "
        f"{common.machine_line(common.device())}"
    )
    return note + "\n\n" + common.table(headers, body)


# ----- main ---------------------------------------------------------------------------------------------------


def check_memory(worlds: list[int], param_count: int) -> None:
    """Every rank of the largest world may hold up to ~2x the fp32 model during loading, plus ~1 GiB of its own."""
    total, available_bytes = mem_info()
    need = max(worlds) * (2 * 4 * param_count + GiB) + 2 * 4 * param_count  # + this process writing the folders
    print(
        f"machine memory: {total / GiB:.1f} GiB total, {available_bytes / GiB:.1f} GiB available; this run needs "
        f"up to ~{need / GiB:.1f} GiB ({max(worlds)} ranks x (2 x the {4 * param_count / GiB:.2f} GiB fp32 model "
        "+ 1 GiB))",
        file=sys.stderr,
        flush=True,
    )
    if need > available_bytes:
        raise SystemExit(
            f"not enough memory: ~{need / GiB:.1f} GiB needed, {available_bytes / GiB:.1f} GiB available. "
            "Lower --params or the largest of --worlds, or free memory."
        )


def parse(argv=None):
    parser = argparse.ArgumentParser(description="Per-rank peak host memory of the Flux recipe on a large model")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="processes (cp 2, dp = world / 2)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(DEFAULT_MODES))
    parser.add_argument("--params", type=float, default=160, help="transformer size, millions of parameters")
    # narrow and deep, like the real models: one block is ~3 % of the model (FLUX.1's double blocks 2.8 %), so
    # FSDP's gathered blocks in flight do not swamp the loading figures (at width 1024, 3+3 blocks: 24 % each);
    # the run's excess over the model is per layer, so a narrow model shows it larger than a real one (--hidden 768
    # at the same depth: DDP bf16 1.05x instead of 1.16x; docs/benchmarks.md, 2026-12-06)
    parser.add_argument("--hidden", type=int, default=384, help="transformer width (a multiple of 64)")
    # rank 1: the LoRA's parameters, gradients and AdamW moments are 1 % of the fp32 model (rank 16: 17 %), so the
    # figures are the base's loading, not the adapter's training state
    parser.add_argument("--lora-rank", type=int, default=1, help="the recipe's model.lora_rank")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "scale_memory", help="model folders, runs")
    parser.add_argument("--cache", type=Path, default=None, help="tiny pipeline and data cache (default: OUT/cache)")
    parser.add_argument("--keep", action="store_true", help="keep the model folders (reused by the next run)")
    parser.add_argument(
        "--onednn-caches",
        choices=("capped", "default"),
        default="capped",
        help=f"oneDNN/ideep matmul plan caches in the ranks: {ONEDNN_CACHE} entries, or their default 1024",
    )
    parser.add_argument("--interval", type=float, default=0.02, help="RSS polling period, seconds")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per recipe run")
    args = parser.parse_args(argv)
    for world in args.worlds:
        if world % CP:
            raise ValueError(f"--worlds must be multiples of cp={CP}, got {world}.")
    args.out = args.out.resolve()
    args.cache = (args.cache or args.out / "cache").resolve()
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    started = time.perf_counter()
    config = flux_config(args.params, args.hidden)
    param_count = config["param_count"]
    check_memory(args.worlds, param_count)
    options = model_options()
    folders = write_model_folders(args.out, args.cache, config)
    # unmeasured warm-up: builds the data cache, so that every measured run (the baselines too) only reads it
    measure("warmup", MODES["ddp"], world=min(args.worlds), pretrained="tiny", args=args)
    all_rows, tables = [], []
    for world in args.worlds:
        baselines, results = {}, {}
        for key in args.modes:
            mode = MODES[key]
            if not available(mode, options):
                results[key] = None
                continue
            wrapping = "fsdp" if mode.fsdp else "ddp"
            if wrapping not in baselines:
                baselines[wrapping] = measure(
                    f"tiny_{wrapping}", MODES[wrapping], world=world, pretrained="tiny", args=args
                )
            results[key] = measure(key, mode, world=world, pretrained=str(folders[mode.files]), args=args)
        rows = rows_for_world(world, results, baselines, param_count)
        all_rows += rows
        tables.append(render(world, rows, param_count, baselines, args.onednn_caches))
        print("\n" + tables[-1] + "\n", flush=True)
    if not args.keep:
        for folder in folders.values():
            shutil.rmtree(folder, ignore_errors=True)
    text = "\n\n".join(tables)
    (args.out / "scale_memory.md").write_text(text + "\n")
    print(f"total {time.perf_counter() - started:.0f} s; tables in {args.out / 'scale_memory.md'}", file=sys.stderr)
    return {"rows": all_rows, "table": text, "param_count": param_count}


if __name__ == "__main__":
    main()
