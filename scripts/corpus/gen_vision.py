"""Simple pictures with a question and its answer, English and Chinese, for teaching the demo to see (issue 19).

Five kinds of question, each about one clear fact of a 128x128 picture on a plain light background:

* shape: one shape (circle, square, triangle, star) of any colour -> its name;
* colour: one shape of one of six colours -> the colour;
* count: 1-4 shapes of one kind and colour, apart -> how many;
* digit: one large digit 0-9 drawn as seven segments (PIL polygons, so no font is needed) -> the digit;
* position: one small shape near the left, right, top or bottom edge -> that side.

Sizes, places, rotations, line thickness, slant and the background tint vary. Pictures are drawn at twice the
size and shrunk, so edges are smooth as in a photo of a drawing.

Train / held-out split: every scene has a key, its parameters rounded (kind, values, centres to 16 px, sizes to
8 px, angles to 15 degrees, background to 8 levels); a scene is held out when the SHA-256 of its key falls in
HELDOUT_FRACTION of the hash range (a circle's angle is left out: it does not show). sample() draws scenes until
one of the asked split comes, so no held-out scene has the key of any training scene: held-out pictures are new
arrangements (a training scene can still be close, across the edge of a rounding cell), not new words or kinds.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from dataclasses import dataclass

from PIL import Image, ImageDraw

IMAGE_SIZE = 128  # pictures are drawn at 128x128 (a multiple of patch 16 x merge 2): 8x8 patches, 4x4 = 16 merged tokens
SCALE = 2  # drawn at SCALE x IMAGE_SIZE, then shrunk (smooth edges)
HELDOUT_FRACTION = 0.1
KINDS = ("shape", "colour", "count", "digit", "position")
LANGS = ("en", "zh")
SPLITS = ("train", "heldout")

# (English, Chinese, RGB): far apart in hue and lightness, and each far from the light backgrounds.
COLOURS = [
    ("red", "红色", (214, 39, 40)),
    ("green", "绿色", (44, 160, 44)),
    ("blue", "蓝色", (31, 90, 220)),
    ("yellow", "黄色", (240, 190, 0)),
    ("black", "黑色", (25, 25, 25)),
    ("purple", "紫色", (140, 60, 180)),
]
# (English, English plural, Chinese)
SHAPES = [
    ("circle", "circles", "圆形"),
    ("square", "squares", "正方形"),
    ("triangle", "triangles", "三角形"),
    ("star", "stars", "星形"),
]
# (English as the answer says it, the English key word, Chinese)
POSITIONS = [
    ("on the left", "left", "左边"),
    ("on the right", "right", "右边"),
    ("at the top", "top", "上边"),
    ("at the bottom", "bottom", "下边"),
]
# Seven-segment digits: segments a (top), b (top right), c (bottom right), d (bottom), e (bottom left),
# f (top left), g (middle).
SEGMENTS = {
    0: "abcdef", 1: "bc", 2: "abdeg", 3: "abcdg", 4: "bcfg",
    5: "acdfg", 6: "acdefg", 7: "abc", 8: "abcdefg", 9: "abcdfg",
}
NUMBER_WORDS = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
    "ten": 10,
}
ZH_NUMERALS = {"零": 0, "一": 1, "二": 2, "两": 2, "三": 3, "四": 4, "五": 5, "六": 6, "七": 7, "八": 8, "九": 9,
               "十": 10}


@dataclass(slots=True)
class VisionExample:
    image: Image.Image  # RGB, IMAGE_SIZE x IMAGE_SIZE
    question: str
    answer: str  # the short assistant answer, one sentence, in the question's language
    kind: str  # "shape" | "colour" | "count" | "digit" | "position"
    lang: str  # "en" | "zh"
    expected: str  # the key word(s) a correct answer must contain ("red" / "红色", "3", "circle" / "圆形", ...)
    reasoning: str  # a short thinking text for thinking mode


@dataclass(slots=True)
class Item:
    """One shape to draw, in picture pixels (IMAGE_SIZE scale)."""

    shape: int  # index into SHAPES
    colour: int  # index into COLOURS
    cx: float
    cy: float
    r: float  # circumradius
    angle: float  # degrees


@dataclass(slots=True)
class Digit:
    value: int
    colour: int
    cx: float
    cy: float
    height: float
    thickness: float
    slant: float  # x shift per unit of height above the centre (italic)


@dataclass(slots=True)
class Scene:
    kind: str
    background: tuple[int, int, int]
    items: list[Item]
    digit: Digit | None = None
    side: int | None = None  # index into POSITIONS (position scenes)

    def key(self) -> str:
        """The rounded parameters that decide the split (see the module docstring)."""
        parts: list[object] = [self.kind, tuple(c // 32 for c in self.background), self.side]
        parts += sorted((i.shape, i.colour, round(i.cx / 16), round(i.cy / 16), round(i.r / 8),
                         0 if SHAPES[i.shape][0] == "circle" else round(i.angle / 15)) for i in self.items)
        if self.digit is not None:
            d = self.digit
            parts += [d.value, d.colour, round(d.cx / 16), round(d.cy / 16), round(d.height / 8),
                      round(d.thickness / 4), round(d.slant * 10)]
        return repr(parts)

    def split(self) -> str:
        h = int.from_bytes(hashlib.sha256(self.key().encode()).digest()[:8], "big")
        return "heldout" if h < HELDOUT_FRACTION * 2**64 else "train"


# ---- scenes ----

def _background(rng: random.Random) -> tuple[int, int, int]:
    base = rng.randint(228, 252)
    return tuple(min(255, base + rng.randint(-6, 6)) for _ in range(3))  # type: ignore[return-value]


def _one_shape(rng: random.Random, r_lo: float, r_hi: float) -> Item:
    r = rng.uniform(r_lo, r_hi)
    margin = r + 4
    return Item(rng.randrange(len(SHAPES)), rng.randrange(len(COLOURS)), rng.uniform(margin, IMAGE_SIZE - margin),
                rng.uniform(margin, IMAGE_SIZE - margin), r, rng.uniform(-20, 20))


def _apart(rng: random.Random, n: int, shape: int, colour: int) -> list[Item]:
    """n shapes of one kind and colour whose circles keep a gap of 6 px (retrying the whole layout)."""
    while True:
        items: list[Item] = []
        for _ in range(200):
            r = rng.uniform(10, 17)
            m = r + 4
            item = Item(shape, colour, rng.uniform(m, IMAGE_SIZE - m), rng.uniform(m, IMAGE_SIZE - m), r,
                        rng.uniform(-20, 20))
            if all(math.hypot(item.cx - o.cx, item.cy - o.cy) > item.r + o.r + 6 for o in items):
                items.append(item)
                if len(items) == n:
                    return items


def _at_side(rng: random.Random, side: int) -> Item:
    """A shape near one edge (its centre within a quarter of the picture from it) and near the middle of that
    edge (within a tenth of the picture from the centre line), so the side is never in doubt."""
    item = _one_shape(rng, 11, 18)
    near = rng.uniform(item.r + 4, 0.25 * IMAGE_SIZE)
    along = rng.uniform(0.4 * IMAGE_SIZE, 0.6 * IMAGE_SIZE)
    far = IMAGE_SIZE - near
    item.cx, item.cy = [(near, along), (far, along), (along, near), (along, far)][side]
    return item


def _scene(rng: random.Random, kind: str) -> Scene:
    bg = _background(rng)
    if kind in ("shape", "colour"):
        return Scene(kind, bg, [_one_shape(rng, 18, 38)])
    if kind == "count":
        return Scene(kind, bg, _apart(rng, rng.randint(1, 4), rng.randrange(len(SHAPES)),
                                      rng.randrange(len(COLOURS))))
    if kind == "position":
        side = rng.randrange(len(POSITIONS))
        return Scene(kind, bg, [_at_side(rng, side)], side=side)
    if kind == "digit":
        height = rng.uniform(64, 92)
        digit = Digit(rng.randrange(10), rng.randrange(len(COLOURS)), IMAGE_SIZE / 2 + rng.uniform(-14, 14),
                      IMAGE_SIZE / 2 + rng.uniform(-6, 6), height, height * rng.uniform(0.09, 0.16),
                      rng.uniform(-0.15, 0.15))
        return Scene(kind, bg, [], digit=digit)
    raise ValueError(f"unknown question kind {kind!r}; accepted: {', '.join(KINDS)}")


# ---- drawing ----

def _polygon(item: Item) -> list[tuple[float, float]]:
    """The outline of a square, triangle or star around (cx, cy), rotated by item.angle."""
    name = SHAPES[item.shape][0]
    if name == "square":
        radii, start = [item.r] * 4, 45.0
    elif name == "triangle":
        radii, start = [item.r] * 3, -90.0
    else:  # star: five points, inner radius 0.45
        radii, start = [item.r if k % 2 == 0 else 0.45 * item.r for k in range(10)], -90.0
    step = 360 / len(radii)
    out = []
    for k, rad in enumerate(radii):
        a = math.radians(start + item.angle + k * step)
        out.append((item.cx + rad * math.cos(a), item.cy + rad * math.sin(a)))
    return out


def _segments(d: Digit) -> list[list[tuple[float, float]]]:
    """The hexagonal seven-segment polygons of a digit, slanted."""
    h, t = d.height, d.thickness
    w = 0.55 * h
    x0, x1 = d.cx - w / 2, d.cx + w / 2
    y0, ym, y1 = d.cy - h / 2, d.cy, d.cy + h / 2
    gap = 0.15 * t  # a small notch between segments, as a real display has

    def horizontal(y: float) -> list[tuple[float, float]]:
        a, b = x0 + gap, x1 - gap
        return [(a, y), (a + t / 2, y - t / 2), (b - t / 2, y - t / 2), (b, y), (b - t / 2, y + t / 2),
                (a + t / 2, y + t / 2)]

    def vertical(x: float, top: float, bottom: float) -> list[tuple[float, float]]:
        a, b = top + gap, bottom - gap
        return [(x, a), (x + t / 2, a + t / 2), (x + t / 2, b - t / 2), (x, b), (x - t / 2, b - t / 2),
                (x - t / 2, a + t / 2)]

    shapes = {"a": horizontal(y0), "g": horizontal(ym), "d": horizontal(y1), "f": vertical(x0, y0, ym),
              "b": vertical(x1, y0, ym), "e": vertical(x0, ym, y1), "c": vertical(x1, ym, y1)}
    return [[(x + d.slant * (d.cy - y), y) for x, y in shapes[s]] for s in SEGMENTS[d.value]]


def draw(scene: Scene) -> Image.Image:
    size = IMAGE_SIZE * SCALE
    image = Image.new("RGB", (size, size), scene.background)
    pen = ImageDraw.Draw(image)

    def scaled(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
        return [(x * SCALE, y * SCALE) for x, y in points]

    for item in scene.items:
        fill = COLOURS[item.colour][2]
        if SHAPES[item.shape][0] == "circle":
            r = item.r * 0.85  # a circle of the same area as the square drawn for this radius looks larger
            pen.ellipse([(item.cx - r) * SCALE, (item.cy - r) * SCALE, (item.cx + r) * SCALE, (item.cy + r) * SCALE],
                        fill=fill)
        else:
            pen.polygon(scaled(_polygon(item)), fill=fill)
    if scene.digit is not None:
        for segment in _segments(scene.digit):
            pen.polygon(scaled(segment), fill=COLOURS[scene.digit.colour][2])
    return image.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.LANCZOS)


# ---- questions and answers ----

QUESTIONS = {
    ("shape", "en"): ["What shape is this?", "What shape is in the picture?", "Which shape do you see?",
                      "What is the shape in the image?", "Name the shape in the picture."],
    ("shape", "zh"): ["这是什么形状？", "图中是什么形状？", "图片里画的是什么图形？", "你看到的是什么形状？"],
    ("colour", "en"): ["What colour is the shape?", "What color is the shape in the picture?", "Which colour is it?",
                       "What is the colour of the {shape}?", "What color is the {shape}?"],
    ("colour", "zh"): ["这个图形是什么颜色？", "图中的{shape}是什么颜色的？", "它是什么颜色？", "图片里的图形是什么颜色？"],
    ("count", "en"): ["How many {shapes} are there?", "How many {shapes} are in the picture?", "Count the {shapes}.",
                      "How many shapes do you see?", "How many {shapes} can you see?"],
    ("count", "zh"): ["图中有几个{shape}？", "图片里有多少个{shape}？", "数一数有几个{shape}。", "你能看到几个图形？"],
    ("digit", "en"): ["What number is this?", "Which digit is shown?", "What digit is in the picture?",
                      "Read the number in the picture.", "What is the number?"],
    ("digit", "zh"): ["这个数字是几？", "图中是什么数字？", "图片上写的是几？", "这是数字几？"],
    ("position", "en"): ["Where is the {shape}?", "Which side of the picture is the {shape} on?",
                         "Where is the {shape} in the picture?", "On which side is the {shape}?"],
    ("position", "zh"): ["{shape}在图片的哪一边？", "{shape}在哪里？", "{shape}在图片的什么位置？", "图形在哪一边？"],
}


def _text(scene: Scene, lang: str) -> tuple[str, str, str]:
    """(answer, expected key word, reasoning) of a scene in one language."""
    zh = lang == "zh"
    kind = scene.kind
    if kind == "digit":
        assert scene.digit is not None
        v = scene.digit.value
        if zh:
            return f"这个数字是{v}。", str(v), f"用户问图中的数字是几。图中画着一个数字，它是{v}。"
        return f"It is {v}.", str(v), f"The user asks which digit the picture shows. The digit drawn is {v}."
    item = scene.items[0]
    en, plural, zh_name = SHAPES[item.shape]
    if kind == "shape":
        if zh:
            return f"这是{zh_name}。", zh_name, f"用户问图中是什么形状。图中只有一个图形，它是{zh_name}。"
        article = "an" if en[0] in "aeiou" else "a"
        return (f"It is {article} {en}.", en,
                f"The user asks what shape is in the picture. There is one shape, and it is {article} {en}.")
    if kind == "colour":
        c_en, c_zh, _ = COLOURS[item.colour]
        if zh:
            return f"是{c_zh}的。", c_zh, f"用户问图中图形的颜色。这个{zh_name}是{c_zh}的。"
        return f"It is {c_en}.", c_en, f"The user asks for the colour of the shape in the picture. The {en} is {c_en}."
    if kind == "count":
        n = len(scene.items)
        if zh:
            return f"图中有{n}个{zh_name}。", str(n), f"用户问图中有几个{zh_name}。我一个一个地数，一共是{n}个。"
        noun = en if n == 1 else plural
        verb = "is" if n == 1 else "are"
        return (f"There {verb} {n} {noun}.", str(n),
                f"The user asks how many {plural} are in the picture. Counting them one by one gives {n}.")
    if kind == "position":
        assert scene.side is not None
        phrase, word, side_zh = POSITIONS[scene.side]
        if zh:
            return f"{zh_name}在图片的{side_zh}。", side_zh, f"用户问{zh_name}在图片的哪一边。它靠近图片的{side_zh}。"
        return (f"The {en} is {phrase}.", word,
                f"The user asks where the {en} is in the picture. It is near the {word} edge.")
    raise ValueError(f"unknown question kind {kind!r}")


def sample(rng: random.Random, split: str, kind: str | None = None, lang: str | None = None) -> VisionExample:
    """One example of `split` ("train" or "heldout"; disjoint by scene key, see the module docstring); kind and
    lang are drawn uniformly unless given."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not known; accepted: {', '.join(SPLITS)}")
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown question kind {kind!r}; accepted: {', '.join(KINDS)}")
    if lang is not None and lang not in LANGS:
        raise ValueError(f"unknown language {lang!r}; accepted: {', '.join(LANGS)}")
    kind = kind or rng.choice(KINDS)
    lang = lang or rng.choice(LANGS)
    while True:
        scene = _scene(rng, kind)
        if scene.split() == split:
            break
    return example_of(scene, lang, rng.randrange(len(QUESTIONS[kind, lang])))


def example_of(scene: Scene, lang: str, phrasing: int = 0) -> VisionExample:
    """The example of one scene: its picture, question (QUESTIONS[scene.kind, lang][phrasing]) and answer."""
    item = scene.items[0] if scene.items else None
    names = {"shape": "", "shapes": ""} if item is None else {
        "shape": SHAPES[item.shape][2] if lang == "zh" else SHAPES[item.shape][0], "shapes": SHAPES[item.shape][1]}
    question = QUESTIONS[scene.kind, lang][phrasing].format(**names)
    answer, expected, reasoning = _text(scene, lang)
    return VisionExample(draw(scene), question, answer, scene.kind, lang, expected, reasoning)


# ---- judging an answer ----

def _english(word: str) -> re.Pattern[str]:
    return re.compile(rf"\b{re.escape(word)}s?\b", re.IGNORECASE)


# Per kind with named values: (English word, Chinese word, the Chinese stem that finds a mention: 红 finds 红色 and
# 红的) of each value.
VALUES = {
    "colour": [(en, zh, zh[0]) for en, zh, _ in COLOURS],
    "shape": [(en, zh, stem) for (en, _, zh), stem in zip(SHAPES, ["圆", "正方", "三角", "星"], strict=True)],
    "position": [(word, zh, zh[0]) for _, word, zh in POSITIONS],
}


def _numbers(text: str) -> set[int]:
    found = {int(m) for m in re.findall(r"\d+", text)}
    found |= {v for w, v in NUMBER_WORDS.items() if re.search(rf"\b{w}\b", text, re.IGNORECASE)}
    words = text.replace("三角", "")  # the 三 of 三角形 (triangle) is no number
    return found | {v for c, v in ZH_NUMERALS.items() if c in words}


def final_answer(text: str, thinking: bool = False) -> str | None:
    """The text after the last </think>; with thinking, None when the model never closed its thinking."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1].strip()
    return None if thinking else text.strip()


def answer_is_right(example: VisionExample, text: str, thinking: bool = False) -> bool:
    """The model's final answer (after </think>; with thinking=True there must be one) contains `expected` and
    mentions no other value of the same kind: no other colour, shape or side, in English or Chinese; for
    counts and digits no other number (digits, English number words or Chinese numerals)."""
    answer = final_answer(text, thinking)
    if not answer:
        return False
    if example.kind in ("count", "digit"):
        return _numbers(answer) == {int(example.expected)}
    values = VALUES[example.kind]
    mentioned = {i for i, (en, _, stem) in enumerate(values) if _english(en).search(answer) or stem in answer}
    wanted = next(i for i, (en, zh, _) in enumerate(values) if example.expected in (en, zh))
    contains = example.expected in answer if example.lang == "zh" else _english(example.expected).search(answer)
    return bool(contains) and mentioned == {wanted}
