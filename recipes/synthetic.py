"""Synthetic data for the recipes' default runs and the tests: captioned coloured shapes, as still
images or as GIF clips of a shape moving right, in imagefolder layout (``metadata.jsonl``).

It sits below the rest of ``recipes/``: the data module (``recipes.data``) writes it when
``data_dir`` is empty, and the tiny VAE fit (``recipes.tiny_vae``) trains on it; it imports neither.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square", "triangle")


def draw_shape(size: int, colour: str, shape: str, cx: int, cy: int, r: int) -> Image.Image:
    image = Image.new("RGB", (size, size), (245, 245, 240))
    draw = ImageDraw.Draw(image)
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        draw.ellipse(box, fill=COLOURS[colour])
    elif shape == "square":
        draw.rectangle(box, fill=COLOURS[colour])
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLOURS[colour])
    return image


def make_shapes(folder: str | Path, n: int, size: int = 32, seed: int = 0, frames: int = 1) -> Path:
    """Write ``n`` captioned items in imagefolder layout: one coloured shape each, as a still image
    (``frames == 1``) or as an animated GIF of the shape moving to the right."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        r = rng.randint(size // 5, size // 3)
        cx, cy = rng.randint(r, size - r), rng.randint(r, size - r)
        if frames == 1:
            name, caption = f"{i:05d}.png", f"a {colour} {shape}"
            draw_shape(size, colour, shape, cx, cy, r).save(folder / name)
        else:
            name, caption = f"{i:05d}.gif", f"a {colour} {shape} moving right"
            step = max(1, (size - 2 * r) // frames)
            clip = [draw_shape(size, colour, shape, min(size - r, r + k * step), cy, r) for k in range(frames)]
            clip[0].save(folder / name, save_all=True, append_images=clip[1:], duration=100, loop=0)
        lines.append(json.dumps({"file_name": name, "text": caption}))
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return folder
