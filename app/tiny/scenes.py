"""Deterministic synthetic scenes: simple coloured shapes on textured backgrounds, with the
matching caption in plain English. Used to train the bundled model and to check it.

A scene is a 3x3 grid of cells on a canvas of random size and aspect ratio; 1 to 4 objects
occupy distinct cells. Each object has a shape, a colour and a size (large fills most of its
cell, small about half), jittered within its cell. The caption lists the objects in reading
order (top row first, left to right):

    "a large red circle on the left and a small blue star at the top right"
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle", "star", "ring", "diamond")
COLOURS = {
    "red": (220, 30, 30), "orange": (245, 140, 20), "yellow": (240, 220, 30), "green": (40, 170, 50),
    "cyan": (30, 200, 210), "blue": (35, 70, 220), "purple": (140, 50, 190), "pink": (245, 120, 190),
}
SIZES = ("small", "large")
ROWS = ("top", "middle", "bottom")
COLUMNS = ("left", "centre", "right")
BACKGROUNDS = ((200, 200, 200), (160, 160, 155), (110, 110, 115), (70, 72, 75), (215, 205, 185), (150, 140, 125))
MIN_SIDE, MAX_SIDE = 224, 392


def position_phrase(row: int, col: int) -> str:
    vertical, horizontal = ROWS[row], COLUMNS[col]
    if vertical == "middle":
        return "in the centre" if horizontal == "centre" else f"on the {horizontal}"
    if horizontal == "centre":
        return f"at the {vertical}"
    return f"at the {vertical} {horizontal}"


@dataclass(frozen=True)
class SceneObject:
    shape: str
    colour: str
    size: str
    row: int
    col: int

    def phrase(self) -> str:
        return f"a {self.size} {self.colour} {self.shape} {position_phrase(self.row, self.col)}"


@dataclass
class Scene:
    image: Image.Image
    objects: list[SceneObject]

    @property
    def caption(self) -> str:
        return caption_of(self.objects)


def caption_of(objects: list[SceneObject]) -> str:
    phrases = [o.phrase() for o in sorted(objects, key=lambda o: (o.row, o.col))]
    return phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]


def make_scene(seed: int) -> Scene:
    """The scene for `seed`: same seed, same pixels and caption, on any machine."""
    rng = random.Random(seed)
    width, height = rng.randint(MIN_SIDE, MAX_SIDE), rng.randint(MIN_SIDE, MAX_SIDE)
    cells = rng.sample(range(9), rng.randint(1, 4))
    objects = [SceneObject(rng.choice(SHAPES), rng.choice(list(COLOURS)), rng.choice(SIZES), c // 3, c % 3)
               for c in sorted(cells)]
    image = _background(rng, width, height)
    draw = ImageDraw.Draw(image)
    cell_w, cell_h = width / 3, height / 3
    for obj in objects:
        side = min(cell_w, cell_h)
        extent = side * (rng.uniform(0.78, 0.92) if obj.size == "large" else rng.uniform(0.42, 0.52))
        slack_x, slack_y = (cell_w - extent) / 2, (cell_h - extent) / 2
        cx = (obj.col + 0.5) * cell_w + rng.uniform(-slack_x, slack_x) * 0.8
        cy = (obj.row + 0.5) * cell_h + rng.uniform(-slack_y, slack_y) * 0.8
        _draw_shape(draw, obj.shape, _jitter(rng, COLOURS[obj.colour]), cx, cy, extent / 2, rng)
    return Scene(_noise(rng, image), objects)


def _jitter(rng: random.Random, colour: tuple[int, int, int], amount: int = 18) -> tuple[int, int, int]:
    return tuple(max(0, min(255, c + rng.randint(-amount, amount))) for c in colour)  # type: ignore[return-value]


def _background(rng: random.Random, width: int, height: int) -> Image.Image:
    base = np.array(_jitter(rng, rng.choice(BACKGROUNDS), 12), dtype=np.float32)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    angle = rng.uniform(0, 2 * math.pi)
    gradient = (np.cos(angle) * xx / width + np.sin(angle) * yy / height) * rng.uniform(-25, 25)
    pixels = base[None, None, :] + gradient[..., None]
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(0, 6)):  # faint texture strokes
        shade = tuple(int(v) + rng.randint(-20, 20) for v in base)
        x0, y0 = rng.uniform(0, width), rng.uniform(0, height)
        draw.line([(x0, y0), (x0 + rng.uniform(-80, 80), y0 + rng.uniform(-80, 80))], fill=shade,
                  width=rng.randint(1, 3))
    return image


def _noise(rng: random.Random, image: Image.Image) -> Image.Image:
    noise = np.random.default_rng(rng.getrandbits(32)).normal(0, rng.uniform(2, 9), (image.height, image.width, 3))
    return Image.fromarray(np.clip(np.asarray(image, np.float32) + noise, 0, 255).astype(np.uint8), "RGB")


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, colour: tuple[int, int, int], cx: float, cy: float,
                r: float, rng: random.Random) -> None:
    rot = rng.uniform(-0.25, 0.25)
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
    elif shape == "ring":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], outline=colour, width=max(2, int(r * 0.32)))
    elif shape == "square":
        draw.polygon(_regular(cx, cy, r * 0.95, 4, math.pi / 4 + rot), fill=colour)
    elif shape == "diamond":
        draw.polygon(_regular(cx, cy, r, 4, rot * 0.4), fill=colour)
    elif shape == "triangle":
        draw.polygon(_regular(cx, cy + r * 0.15, r, 3, -math.pi / 2 + rot), fill=colour)
    elif shape == "star":
        points = []
        for k in range(10):
            radius = r if k % 2 == 0 else r * 0.45
            angle = -math.pi / 2 + rot + k * math.pi / 5
            points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
        draw.polygon(points, fill=colour)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def _regular(cx: float, cy: float, r: float, sides: int, start: float) -> list[tuple[float, float]]:
    return [(cx + r * math.cos(start + 2 * math.pi * k / sides), cy + r * math.sin(start + 2 * math.pi * k / sides))
            for k in range(sides)]


_PHRASE = re.compile(r"a (small|large) (\w+) (\w+) (?:at the|on the|in the) [\w ]+?(?=, a |\s+and a |$)")


def parse_caption(text: str) -> list[tuple[str, str, str]]:
    """(size, colour, shape) of every object a caption mentions, in order."""
    return [m.groups() for m in _PHRASE.finditer(text.strip())]


def score(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Exact-caption accuracy, the share of scenes whose objects all have the right colour and
    shape (as a multiset, ignoring size and position), and per-object colour+shape accuracy."""
    exact = sum(p.strip() == r for p, r in zip(predictions, references))
    scenes_ok = objects_ok = objects = 0
    for p, r in zip(predictions, references):
        got = sorted((c, s) for _, c, s in parse_caption(p))
        want = sorted((c, s) for _, c, s in parse_caption(r))
        scenes_ok += got == want
        remaining = list(got)
        for item in want:
            if item in remaining:
                remaining.remove(item)
                objects_ok += 1
        objects += len(want)
    n = max(1, len(references))
    return {"exact": exact / n, "colour_shape_scenes": scenes_ok / n, "colour_shape_objects": objects_ok / max(1, objects),
            "n": len(references)}
