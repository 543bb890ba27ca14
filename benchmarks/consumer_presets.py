"""The consumer-GPU presets (configs/consumer/) and their what-fits table, each layout the planner's choice.

``PYTHONPATH=. python benchmarks/consumer_presets.py`` prints the table (Markdown) for docs/planning.md and
docs/consumer-gpus.md; ``--write`` (re)writes configs/consumer/*.yaml from it. For each model and sample size and
each set of cards (2 x 24 GB, 4 x 24 GB, 2 x 32 GB, one PCIe node without NVLink), the planner searches every
layout (cp, ring, DDP / FSDP / HSDP, checkpointing, activation offload, a bf16 or fp8 frozen base) over
``--interconnect pcie`` at an RTX 4090's throughput and takes the fastest per sample among those that fit. Where
none fits, the table says so and no preset is written. tests/test_configs.py checks that every preset is what
this script writes. Everything is predicted on the meta device: no GPU, no weights.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from cp_lightning.planner import Estimate, Hardware, Training, resolve_model, search
from cp_lightning.planner.traffic import PCIE4_GBPS, RTX4090_TFLOPS

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "configs" / "consumer"
# usable GiB per card: the card's memory less ~0.5 GiB that the driver (and a desktop, if it draws one) holds
CARDS = {"2x24gb": (2, 23.5, "2 x 24 GB"), "4x24gb": (4, 23.5, "4 x 24 GB"), "2x32gb": (2, 31.5, "2 x 32 GB")}
LINK, TFLOPS = "pcie", RTX4090_TFLOPS
RATIOS = [0.5625, 0.6667, 0.75, 1.0, 1.3333, 1.5, 1.7778]


@dataclass(frozen=True)
class Setup:
    stem: str  # the preset's file name before the cards
    model: str  # the planner's built-in name
    title: str
    family: str  # wan | flux | qwenimage
    hub: str
    resolution: int
    width: int | None = None  # video: fixed width; images: aspect-ratio buckets of resolution^2 pixels
    frames: int = 1
    rank: int = 32
    text: int = 512  # text tokens (split with the image tokens for Flux and QwenImage)

    def buckets(self) -> list[tuple[int, int]]:
        if self.width is not None:
            return [(self.resolution, self.width)]
        from recipes.buckets import resolutions

        return resolutions(self.resolution**2, RATIOS, 16)

    def tokens(self) -> int:
        """The largest bucket's tokens through attention (text not included): 8x VAE, 2x2 patches, Wan's 4x
        temporal VAE keeping the first frame."""
        latent_frames = (self.frames - 1) // 4 + 1
        return max(latent_frames * (h // 16) * (w // 16) for h, w in self.buckets())

    def sample(self) -> str:
        if self.width is not None:
            return f"{self.width}x{self.resolution} px x {self.frames} frames"
        return f"{self.resolution} px (aspect-ratio buckets)"


SETUPS = [
    Setup("wan2.1_t2v_14b_lora_480p", "wan2.1-t2v-14b", "Wan2.1-T2V-14B LoRA (rank 32)", "wan",
          "Wan-AI/Wan2.1-T2V-14B-Diffusers", 480, 832, 81),
    Setup("wan2.1_t2v_14b_lora_720p", "wan2.1-t2v-14b", "Wan2.1-T2V-14B LoRA (rank 32)", "wan",
          "Wan-AI/Wan2.1-T2V-14B-Diffusers", 720, 1280, 81),
    Setup("wan2.2_t2v_a14b_lora_480p", "wan2.2-t2v-a14b", "Wan2.2-T2V-A14B LoRA (rank 32, one expert)", "wan",
          "Wan-AI/Wan2.2-T2V-A14B-Diffusers", 480, 832, 81),
    Setup("flux1_dev_lora_1024", "flux.1-dev", "FLUX.1-dev LoRA (rank 16)", "flux", "black-forest-labs/FLUX.1-dev",
          1024, rank=16),
    Setup("qwen_image_lora_1328", "qwen-image", "Qwen-Image LoRA (rank 16)", "qwenimage", "Qwen/Qwen-Image", 1328,
          rank=16),
]  # fmt: skip


def plan(setup: Setup, cards: str) -> list[Estimate]:
    """The planner's estimates for ``setup`` on ``cards`` over PCIe, fitting layouts first, fastest first."""
    gpus, memory, _ = CARDS[cards]
    hw = Hardware(gpus=gpus, gpu_memory_gib=memory, intra_node_gbps=PCIE4_GBPS, tflops=TFLOPS)
    text = setup.text if setup.family != "wan" else None  # Wan's text is cross-attention: not split
    return search(resolve_model(setup.model), hw, Training(lora_rank=setup.rank), [setup.tokens()], text_tokens=text)


def command(setup: Setup, cards: str) -> str:
    memory = CARDS[cards][1]
    return (
        f"python -m cp_lightning.plan --config configs/consumer/{setup.stem}_{cards}.yaml --gpu-memory {memory:g} "
        f"--interconnect {LINK} --tflops {TFLOPS:g} --search"
    )


def table() -> str:
    head = "| model, sample | tokens | " + " | ".join(f"{c[2]} (PCIe)" for c in CARDS.values()) + " |"
    lines = [head, "|---|---|" + "---|" * len(CARDS)]
    for setup in SETUPS:
        cells = []
        for cards in CARDS:
            estimates = plan(setup, cards)
            e = estimates[0]
            if e.fits:
                cells.append(f"{e.layout.describe()}: {e.gib_per_gpu:.1f} GiB")
            else:
                cells.append(f"does not fit (leanest {min(x.total for x in estimates) / 2**30:.1f} GiB)")
        lines.append(f"| {setup.title}, {setup.sample()} | {setup.tokens()} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _strategy(e: Estimate) -> list[str]:
    lay = e.layout
    out = [f"      cp: {lay.cp}"]
    if lay.ring > 1:
        out.append(f"      ring: {lay.ring}")
    if lay.fsdp != "off":
        out.append("      fsdp: true")
    if lay.fsdp == "hsdp":
        out.append("      hsdp: true")
    return out


def _model(setup: Setup, e: Estimate) -> list[str]:
    lay = e.layout
    out = [f"  gradient_checkpointing: {str(lay.checkpointing).lower()}"]
    if lay.offload:
        out.append("  activation_offload: true  # the checkpointed blocks' inputs wait in pinned CPU memory")
    out.append("  weights_dtype: bfloat16")
    if lay.base_dtype != "bfloat16":
        out.append(f"  base_dtype: {lay.base_dtype}  # the frozen base's linear weights in fp8 (cp_lightning.fp8)")
    return out


FAMILY = {
    "wan": dict(
        data_dir="data/my_videos         # mp4/webm/mov/gif + .txt captions or metadata.jsonl (docs/recipes/data.md)",
        samples=["num_inference_steps: 30", "max_sequence_length: 512", "guidance_scale: 5.0",
                 'prompts: ["a red fox running through snow, cinematic"]'],
        model=["learning_rate: 0.0001", "lr_scheduler: constant", "warmup_steps: 100"],
        data=["batch_size: 1", "max_sequence_length: 512", "caption_dropout: 0.1             # empty caption for 10% "
              "of samples (keeps CFG working)", "encode_dtype: bfloat16           # the encoders while caching",
              "vae_tiling: true"],
    ),
    "flux": dict(
        data_dir="data/my_images         # images + .txt captions or metadata.jsonl (docs/recipes/data.md)",
        samples=["num_inference_steps: 28", "max_sequence_length: 512",
                 "guidance_scale: 3.5  # FLUX.1-dev's distilled guidance at inference",
                 'prompts: ["a photo of a red fox in the snow", "a watercolor painting of a lighthouse"]'],
        model=["learning_rate: 0.0001", "lr_scheduler: constant", "warmup_steps: 100",
               "resolution_shift: true  # Flux: shift from the image token count", "guidance_scale: 1.0"],
        data=[f"aspect_ratios: {RATIOS}  # width / height", "batch_size: 1", "max_sequence_length: 512",
              "caption_dropout: 0.1             # empty caption for 10% of samples (keeps CFG working)",
              "encode_dtype: bfloat16           # the encoders while caching"],
    ),
    "qwenimage": dict(
        data_dir="data/my_images         # images + .txt captions or metadata.jsonl (docs/recipes/data.md)",
        samples=["num_inference_steps: 30", "true_cfg_scale: 4.0  # Qwen-Image's classifier-free guidance",
                 'negative_prompt: " "', "max_sequence_length: 512",
                 'prompts: ["a photo of a red fox in the snow", "a watercolor painting of a lighthouse"]'],
        model=["learning_rate: 0.0001", "lr_scheduler: constant", "warmup_steps: 100",
               "resolution_shift: true  # Qwen-Image's shift from the image token count"],
        data=[f"aspect_ratios: {RATIOS}  # width / height", "batch_size: 1", "max_sequence_length: 512",
              "caption_dropout: 0.1             # empty caption for 10% of samples (keeps CFG working)",
              "encode_dtype: bfloat16           # the encoders while caching"],
    ),
}  # fmt: skip
EXPERT = ["expert: high_noise  # trains `transformer` on t in [0.875, 1]; low_noise: `transformer_2` on [0, 0.875]",
          "boundary_ratio: 0.875"]  # fmt: skip
SHIFT = {"wan2.1_t2v_14b_lora_480p": "shift: 3.0  # Wan 480p practice (its pipeline samples 480p with flow_shift 3.0)",
         "wan2.1_t2v_14b_lora_720p": "shift: 5.0  # Wan 720p practice (its pipeline samples with flow_shift 5.0)",
         "wan2.2_t2v_a14b_lora_480p": "shift: 12.0  # Wan2.2-T2V-A14B samples with flow shift 12"}  # fmt: skip


def header(setup: Setup, cards: str, e: Estimate) -> list[str]:
    gpus, memory, what = CARDS[cards]
    g = e.as_dict()["gib"]
    lay = e.layout
    per_rank = -(-setup.tokens() // lay.cp)
    lines = [
        f"{setup.title} at {setup.sample()} on {what} cards in one PCIe node (no NVLink).",
        "Generated by benchmarks/consumer_presets.py: the layout planner's choice for these cards,",
        "  " + command(setup, cards),
        f"-> {lay.describe()}: the fastest predicted per sample among the layouts that fit (the planner's",
        "largest bucket of these sizes; without --search it evaluates this file's own layout).",
        f"Largest sample: {setup.tokens()} tokens through attention ({per_rank} per GPU at cp={lay.cp})"
        + (
            f" + {setup.text} text tokens split with them."
            if setup.family != "wan"
            else "; Wan's 512 text tokens are cross-attention keys, not split."
        ),
        f"Planner estimate: {e.gib_per_gpu:.1f} GiB per GPU of {memory:g} usable: states {g['states']:.1f}, FSDP "
        f"in-flight {g['fsdp_in_flight']:.1f}, activations {g['activations']:.1f}, CP buffers {g['cp_buffers']:.1f}, "
        f"fixed {g['fixed']:.2f} (CUDA context + NCCL buffers), margin {g['margin']:.1f} (10% of what is allocated and "
        "freed every step). A prediction on the meta device, not a GPU measurement.",
        "Samples while training are off (samples.enabled: false): the pipeline's text encoder"
        + (" and Wan2.2's other 14B expert" if "a14b" in setup.stem else "")
        + " would sit on the GPU next to what training holds (above), more than these cards have; render with the "
        "exported LoRA after training (docs/consumer-gpus.md).",
    ]
    if "a14b" in setup.stem:
        lines.append("A14B is two 14B experts; one run trains one (model.expert), run again with --model.expert "
                     "low_noise (and another out_dir) for the other.")  # fmt: skip
    out = []
    for line in lines:  # wrap at 116 characters, the command excepted
        if line.startswith("  python"):
            out.append(line)
            continue
        words, cur = line.split(" "), ""
        for w in words:
            if cur and len(cur) + 1 + len(w) > 116:
                out.append(cur)
                cur = w
            else:
                cur = f"{cur} {w}" if cur else w
        out.append(cur)
    return ["# " + line for line in out]


def render(setup: Setup, cards: str, e: Estimate) -> str:
    """The preset's YAML text for ``setup`` on ``cards`` with the planner's chosen estimate ``e``."""
    gpus = CARDS[cards][0]
    f = FAMILY[setup.family]
    run = f"outputs/consumer/{setup.stem}_{cards}"
    size = [f"resolution: {setup.resolution}"]
    if setup.width is not None:
        size += [f"width: {setup.width}", f"num_frames: {setup.frames}"]
    model = [f"pretrained: {setup.hub}"] + (EXPERT if "a14b" in setup.stem else []) + ["cache_dir: outputs/cache"]
    model += [f"lora_rank: {setup.rank}"] + f["model"] + ([SHIFT[setup.stem]] if setup.stem in SHIFT else [])
    lines = header(setup, cards, e) + [
        "seed_everything: 0",
        f"out_dir: {run}  # samples/, checkpoints/, lora/, loss.csv",
        "trainer:",
        "  accelerator: cuda",
        f"  devices: {gpus}",
        "  strategy:",
        "    class_path: cp_lightning.ContextParallelStrategy",
        "    init_args:",
        *_strategy(e),
        "  precision: bf16-mixed",
        "  max_steps: 3000",
        "  gradient_clip_val: 1.0",
        "  use_distributed_sampler: false",
        "  log_every_n_steps: 10",
        f"  default_root_dir: {run}",
        "  callbacks:",
        "    - class_path: recipes.console.StepProgressBar",
        "samples:",
        "  enabled: false  # see above: the text encoder does not fit next to training on these cards",
        *[f"  {x}" for x in size],
        *[f"  {x}" for x in f["samples"]],
        "checkpoint:",
        "  every_n_steps: 500",
        "  keep_last: 3",
        "export:",
        "  format: diffusers",
        "model:",
        *[f"  {x}" for x in model],
        *_model(setup, e),
        "data:",
        f"  data_dir: {f['data_dir']}",
        "  cache_dir: outputs/cache",
        f"  pretrained: {setup.hub}",
        *[f"  {x}" for x in size],
        *[f"  {x}" for x in f["data"]],
    ]
    return "\n".join(lines) + "\n"


def presets() -> dict[str, str]:
    """{file name: YAML text} of every combination that fits."""
    out = {}
    for setup in SETUPS:
        for cards in CARDS:
            e = plan(setup, cards)[0]
            if e.fits:
                out[f"{setup.stem}_{cards}.yaml"] = render(setup, cards, e)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="(re)write configs/consumer/*.yaml")
    a = p.parse_args(argv)
    print(table())
    if a.write:
        FOLDER.mkdir(parents=True, exist_ok=True)
        for name, text in presets().items():
            (FOLDER / name).write_text(text)
            print(f"wrote {FOLDER / name}")


if __name__ == "__main__":
    main()
