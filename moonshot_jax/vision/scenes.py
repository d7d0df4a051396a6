"""Synthetic scenes for the vision-language corpus: sampled descriptions, Pillow rendering, questions.

A `Scene` is a frozen, hashable description (image size, background, objects with pixel geometry, or
a digit); `render(scene)` draws it (deterministic: no randomness at render time) and
`render(scene, blank=True)` draws the same canvas with nothing on it (the "images blanked" control).
Three kinds, each with one question type answerable only from the pixels:

  single  one shape (circle / square / triangle) in one colour in one quadrant -> colour, shape, position
  count   1..4 shapes in distinct quadrants                                     -> count
  digit   one digit 0..9 drawn in DejaVu Sans Bold                             -> digit

Sizes are mixed (56..112 px per side, not always square), so the encoder sees several native
resolutions and the packer mixes 4..16 merged tokens per image.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np
from PIL import Image, ImageDraw, ImageFont

COLOURS = {"red": (220, 40, 40), "green": (30, 160, 60), "blue": (40, 80, 230), "yellow": (235, 200, 20)}
SHAPES = ("circle", "square", "triangle")
QUADRANTS = ("top left", "top right", "bottom left", "bottom right")
SIZES = ((56, 56), (56, 84), (84, 56), (84, 84), (84, 112), (112, 84), (112, 112))  # (h, w) px
BACKGROUNDS = ((255, 255, 255), (235, 235, 235))
NUMBER_WORDS = ("zero", "one", "two", "three", "four")
# answers of each question type: exact-match chance level is 1 / len
ANSWERS = {"colour": tuple(COLOURS), "shape": SHAPES, "position": QUADRANTS,
           "count": ("1", "2", "3", "4"), "digit": tuple("0123456789")}
QUESTIONS = {"colour": "What colour is the shape?", "shape": "What shape is it?",
             "position": "Where is the shape?", "count": "How many shapes are there?",
             "digit": "What digit is shown?"}
FONT_NAME = "DejaVuSans-Bold.ttf"
FONT_DIRS = ("/usr/share/fonts/truetype/dejavu", "/usr/share/fonts/dejavu", "/usr/local/share/fonts")


@dataclasses.dataclass(frozen=True)
class Obj:
  shape: str
  colour: str
  quadrant: int
  cx: int
  cy: int
  r: int  # half the side / radius in px


@dataclasses.dataclass(frozen=True)
class Scene:
  kind: str  # "single" | "count" | "digit"
  h: int
  w: int
  background: int  # index into BACKGROUNDS
  objects: tuple[Obj, ...] = ()
  digit: int = -1
  digit_colour: str = ""
  digit_xy: tuple[int, int] = (0, 0)
  font_px: int = 0


def sample_scene(rng: np.random.Generator, kind: str) -> Scene:
  if kind not in ("single", "count", "digit"):
    raise ValueError(f"kind: expected single, count or digit, got {kind!r}")
  h, w = SIZES[rng.integers(len(SIZES))]
  bg = int(rng.integers(len(BACKGROUNDS)))
  if kind == "digit":
    font_px = int(min(h, w) * rng.uniform(0.55, 0.75))
    dx, dy = (int(rng.integers(-6, 7)) for _ in range(2))
    return Scene("digit", h, w, bg, digit=int(rng.integers(10)), digit_colour=str(rng.choice(list(COLOURS))),
                 digit_xy=(w // 2 + dx, h // 2 + dy), font_px=font_px)
  n = 1 if kind == "single" else int(rng.integers(1, 5))
  quads = rng.permutation(4)[:n]
  objs = []
  for q in sorted(int(x) for x in quads):
    qh, qw = h // 2, w // 2
    r = int(min(qh, qw) * rng.uniform(0.28, 0.4))
    cx = (q % 2) * qw + int(rng.integers(r + 1, qw - r))
    cy = (q // 2) * qh + int(rng.integers(r + 1, qh - r))
    objs.append(Obj(str(rng.choice(SHAPES)), str(rng.choice(list(COLOURS))), q, cx, cy, r))
  return Scene(kind, h, w, bg, objects=tuple(objs))


@functools.lru_cache(maxsize=None)
def font_path() -> str:
  for d in FONT_DIRS:
    p = os.path.join(d, FONT_NAME)
    if os.path.isfile(p):
      return p
  raise FileNotFoundError(f"{FONT_NAME} not found in {FONT_DIRS}: install the DejaVu fonts "
                          "(Debian: apt-get install fonts-dejavu-core)")


@functools.lru_cache(maxsize=64)
def _font(px: int) -> ImageFont.FreeTypeFont:
  return ImageFont.truetype(font_path(), px)


def render(scene: Scene, blank: bool = False) -> Image.Image:
  img = Image.new("RGB", (scene.w, scene.h), BACKGROUNDS[scene.background])
  if blank:
    return img
  d = ImageDraw.Draw(img)
  for o in scene.objects:
    box = (o.cx - o.r, o.cy - o.r, o.cx + o.r, o.cy + o.r)
    fill = COLOURS[o.colour]
    if o.shape == "circle":
      d.ellipse(box, fill=fill)
    elif o.shape == "square":
      d.rectangle(box, fill=fill)
    else:
      d.polygon([(o.cx, o.cy - o.r), (o.cx - o.r, o.cy + o.r), (o.cx + o.r, o.cy + o.r)], fill=fill)
  if scene.kind == "digit":
    d.text(scene.digit_xy, str(scene.digit), fill=COLOURS[scene.digit_colour], font=_font(scene.font_px),
           anchor="mm")
  return img


def qtypes(scene: Scene) -> tuple[str, ...]:
  return {"single": ("colour", "shape", "position"), "count": ("count",), "digit": ("digit",)}[scene.kind]


def answer(scene: Scene, qtype: str) -> str:
  if qtype == "digit":
    return str(scene.digit)
  if qtype == "count":
    return str(len(scene.objects))
  o = scene.objects[0]
  return {"colour": o.colour, "shape": o.shape, "position": QUADRANTS[o.quadrant]}[qtype]


def caption(scene: Scene) -> str:
  if scene.kind == "digit":
    return f"The digit {scene.digit} in {scene.digit_colour}."
  if scene.kind == "single":
    o = scene.objects[0]
    return f"A {o.colour} {o.shape} at the {QUADRANTS[o.quadrant]}."
  n = len(scene.objects)
  things = ", ".join(f"{o.colour} {o.shape}" for o in scene.objects)
  return f"{NUMBER_WORDS[n].capitalize()} shape{'s' if n > 1 else ''}: {things}."
