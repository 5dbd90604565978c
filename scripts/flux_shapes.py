"""Coloured shapes with captions, the FLUX demonstration's data (README, FLUX.1): small RGB
images of one red, green or blue circle, square or triangle on white, each captioned "a red
circle" and so on, written as PNG + .txt pairs (forge prep --images' caption-files layout),
and the measure that tells which colour and shape a sampled image shows.

Standard library only (zlib for the PNGs), so it runs wherever python3 does."""
import math
import os
import random
import struct
import zlib

COLOURS = {"red": (255, 0, 0), "green": (0, 160, 0), "blue": (0, 0, 255)}
SHAPES = ("circle", "square", "triangle")
# Area of each shape over its bounding box's, what classify() compares.
FILL = {"circle": math.pi / 4, "square": 1.0, "triangle": 0.5}


def draw(shape, colour, size, rng):
    """A size x size image (rows of (r, g, b)) with one shape of side/diameter about size/2."""
    side = rng.randint(size * 2 // 5, size * 3 // 5)
    x0 = rng.randint(1, size - side - 1)
    y0 = rng.randint(1, size - side - 1)
    rgb = COLOURS[colour]
    image = [[(255, 255, 255)] * size for _ in range(size)]
    for y in range(size):
        for x in range(size):
            u, v = (x + 0.5 - x0) / side, (y + 0.5 - y0) / side  # [0, 1) inside the box
            if not (0 <= u < 1 and 0 <= v < 1):
                continue
            if shape == "circle":
                inside = (u - 0.5) ** 2 + (v - 0.5) ** 2 <= 0.25
            elif shape == "square":
                inside = True
            else:  # apex at the top, base at the bottom
                inside = abs(u - 0.5) <= v / 2
            if inside:
                image[y][x] = rgb
    return image


def write_png(path, image):
    height, width = len(image), len(image[0])
    raw = b"".join(b"\0" + bytes(c for px in row for c in px) for row in image)

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def read_png(path):
    """Rows of (r, g, b) from an 8-bit RGB or RGBA, non-interlaced PNG (what forge sample writes)."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour_type = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour_type in (2, 6), (path, depth, colour_type)
            channels = 3 if colour_type == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw, stride, rows, prev = zlib.decompress(idat), width * channels, [], bytearray(width * channels)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b, c = prev[i], prev[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append([tuple(line[x * channels:x * channels + 3]) for x in range(width)])
        prev = line
    return rows


def make_dataset(folder, per_class=30, size=32, seed=0):
    """per_class images of each of the 9 (colour, shape) captions; returns the captions."""
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(seed)
    captions = []
    for colour in COLOURS:
        for shape in SHAPES:
            caption = f"a {colour} {shape}"
            captions.append(caption)
            for i in range(per_class):
                stem = os.path.join(folder, f"{colour}-{shape}-{i:03d}")
                write_png(stem + ".png", draw(shape, colour, size, rng))
                with open(stem + ".txt", "w") as f:
                    f.write(caption + "\n")
    return captions


def classify(image):
    """(colour, shape) an image shows: the colour whose channel dominates the pixels that are
    not near white, the shape whose fill of their bounding box is nearest; (None, None) when
    there is no such pixel."""
    marked = [(x, y, px) for y, row in enumerate(image) for x, px in enumerate(row) if min(px) < 160]
    if not marked:
        return None, None
    mean = [sum(px[c] for _, _, px in marked) / len(marked) for c in range(3)]
    colour = min(COLOURS, key=lambda name: sum((mean[c] - COLOURS[name][c]) ** 2 for c in range(3)))
    xs, ys = [x for x, _, _ in marked], [y for _, y, _ in marked]
    box = (max(xs) - min(xs) + 1) * (max(ys) - min(ys) + 1)
    fill = len(marked) / box
    shape = min(SHAPES, key=lambda name: abs(FILL[name] - fill))
    return colour, shape
