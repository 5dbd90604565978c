"""forge's image reading (data/image_*.h) against Pillow, which diffusers' FLUX fine-tuning
scripts read images with (Image.open, ImageOps.exif_transpose, convert("RGB"), then
torchvision's Resize / CenterCrop / ToTensor / Normalize on the PIL image):
  - decoding: JPEG (baseline 4:2:0, 4:2:2, 4:4:4, progressive, grayscale, CMYK, optimized
    tables), PNG (RGB, RGBA, gray, gray+alpha, palette with transparency, 1/2/4-bit, 16-bit
    RGB, RGBA and gray+alpha, tRNS colors, Adam7 interlacing), WebP (lossy, lossless, with
    alpha), each against Pillow's convert("RGB") pixels: exact for PNG and lossless WebP;
    JPEG and lossy WebP within 2 levels (Pillow's wheels bundle newer libjpeg-turbo and libwebp
    releases than Debian's, whose SIMD color conversion may round differently); 16-bit gray
    against its high byte (Pillow clips "I;16" to 255 in convert("RGB"): NOTE [PNG decoding]);
  - EXIF orientations 1-8 in JPEG, PNG and WebP against ImageOps.exif_transpose;
  - the bilinear resize against Image.resize(..., BILINEAR), byte for byte, up and down;
  - the bicubic resize against Image.resize(..., BICUBIC) on random sizes, up and down and
    both pass orders, byte for byte;
  - --transform torchtitan against a re-implementation of torchtitan's _process_cc12m_image
    (MLPerf's Flux.1 reference) driven with the crop offsets forge drew, on landscape,
    portrait and square images, RGB, L and opaque RGBA, bit for bit, and its --min-size skip;
  - a bucket's float tensor against Resize + flip + crop + ToTensor + Normalize computed with
    Pillow and torch's float32 (torchvision itself is not installed: its Resize(int) size rule,
    CenterCrop's rounding and ToTensor's arithmetic are restated here), bit for bit;
  - forge's PNG writer, read back by Pillow;
  - refusals, each naming the file: truncated and corrupt JPEG, PNG and WebP, an animated WebP,
    formats forge does not read (GIF, also behind a .png name), not an image at all;
  - the three dataset layouts on temporary folders (caption files, captions in file names as
    bghira/pseudo-camera-10k has them, a JSON Lines manifest) with every refusal: missing and
    empty captions, invalid UTF-8, unreadable images, bad manifest lines.
"""
import io
import json
import math
import os
import shutil
import struct
import subprocess
import unittest
import zlib

import numpy as np
import torch
from PIL import Image, ImageOps

from forge_test_util import scratch_dir, tool

LOSSY_TOLERANCE = 2


def forge(*args):
    return subprocess.run([tool("forge_image_reference"), *map(str, args)], capture_output=True, text=True)


def forge_ok(*args):
    result = forge(*args)
    if result.returncode != 0:
        raise AssertionError(f"forge_image_reference {args} exited {result.returncode}: {result.stderr}")
    return result.stdout


def photo(width, height, seed=0):
    """A photo-like RGB array: gradients, noise and a sharp-edged block."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255.0 / max(width - 1, 1), y * 255.0 / max(height - 1, 1),
                     (x + y) * 127.0 / max(width + height - 2, 1) + 64], axis=-1)
    image = base + rng.normal(0, 24, (height, width, 3))
    image[height // 3:height // 2, width // 4:width // 2] = [250, 30, 60]
    return np.clip(image, 0, 255).astype(np.uint8)


def pil_rgb(path):
    with Image.open(path) as image:
        return np.array(ImageOps.exif_transpose(image).convert("RGB"))


def png_chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


ADAM7 = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)]


def write_png(path, samples, color_type, bit_depth, palette=None, trns=None, interlace=False):
    """A PNG of `samples` (height x width x channels integers) written by hand, for the color
    types and depths Pillow cannot write (16-bit color, 2/4-bit gray, tRNS colors, Adam7)."""
    height, width = samples.shape[:2]

    def pack_rows(pixels):
        rows = b""
        for row in pixels:
            flat = row.reshape(-1).astype(np.int64)
            if bit_depth == 16:
                data = flat.astype(">u2").tobytes()
            elif bit_depth == 8:
                data = flat.astype(np.uint8).tobytes()
            else:
                per_byte = 8 // bit_depth
                flat = np.concatenate([flat, np.zeros((-len(flat)) % per_byte, np.int64)])
                groups = flat.reshape(-1, per_byte)
                data = bytes(int(sum(int(v) << (8 - bit_depth * (i + 1)) for i, v in enumerate(g))) for g in groups)
            rows += b"\0" + data
        return rows

    if interlace:
        raw = b""
        for x0, y0, dx, dy in ADAM7:
            sub = samples[y0::dy, x0::dx]
            if sub.shape[0] and sub.shape[1]:
                raw += pack_rows(sub)
    else:
        raw = pack_rows(samples)
    body = png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, int(interlace)))
    if palette is not None:
        body += png_chunk(b"PLTE", bytes(np.asarray(palette, np.uint8).reshape(-1)))
    if trns is not None:
        body += png_chunk(b"tRNS", trns)
    body += png_chunk(b"IDAT", zlib.compress(raw)) + png_chunk(b"IEND", b"")
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + body)


class Decoding(unittest.TestCase):
    def setUp(self):
        self.dir = scratch_dir()
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def path(self, name):
        return os.path.join(self.dir, name)

    def forge_decode(self, path):
        out = self.path("decoded.rgb")
        meta = json.loads(forge_ok("decode", path, out))
        return np.fromfile(out, np.uint8).reshape(meta["height"], meta["width"], 3)

    def check(self, path, expected=None, tolerance=0):
        expected = pil_rgb(path) if expected is None else expected
        actual = self.forge_decode(path)
        self.assertEqual(actual.shape, expected.shape, path)
        diff = np.abs(actual.astype(np.int32) - expected.astype(np.int32))
        self.assertLessEqual(int(diff.max()), tolerance, f"{os.path.basename(path)}: max difference {diff.max()}, "
                             f"{int((diff > 0).sum())} of {diff.size} samples differ")
        return int(diff.max())

    def test_jpeg(self):
        rgb = Image.fromarray(photo(123, 77, 1))
        cases = {
            "baseline.jpg": dict(quality=90),
            "444.jpg": dict(quality=95, subsampling=0),
            "422.jpg": dict(quality=85, subsampling=1),
            "progressive.jpg": dict(quality=80, progressive=True),
            "optimized.jpg": dict(quality=75, optimize=True),
        }
        worst = {}
        for name, options in cases.items():
            rgb.save(self.path(name), **options)
            worst[name] = self.check(self.path(name), tolerance=LOSSY_TOLERANCE)
        rgb.convert("L").save(self.path("gray.jpg"), quality=90)
        worst["gray.jpg"] = self.check(self.path("gray.jpg"), tolerance=LOSSY_TOLERANCE)
        cmyk = np.random.default_rng(2).integers(0, 256, (40, 57, 4), dtype=np.uint8)
        cmyk[..., 3] //= 3
        Image.fromarray(cmyk, "CMYK").save(self.path("cmyk.jpg"), quality=92)
        with Image.open(self.path("cmyk.jpg")) as image:
            self.assertEqual(image.mode, "CMYK")
        worst["cmyk.jpg"] = self.check(self.path("cmyk.jpg"), tolerance=LOSSY_TOLERANCE)
        print("JPEG: largest difference from Pillow per file:", worst)

    def test_png_color_types_and_depths(self):
        rng = np.random.default_rng(3)
        rgb = photo(45, 31, 4)
        alpha = rng.integers(0, 256, (31, 45), dtype=np.uint8)
        Image.fromarray(rgb).save(self.path("rgb.png"))
        Image.fromarray(np.dstack([rgb, alpha]), "RGBA").save(self.path("rgba.png"))
        Image.fromarray(rgb[..., 0]).save(self.path("gray.png"))
        Image.fromarray(np.dstack([rgb[..., 1], alpha]), "LA").save(self.path("gray_alpha.png"))
        Image.fromarray(rgb[..., 2] > 128).save(self.path("bilevel.png"))
        palette = Image.fromarray(rgb).quantize(colors=50)
        palette.info["transparency"] = 7
        palette.save(self.path("palette.png"), transparency=7)
        Image.fromarray(rgb).quantize(colors=12).save(self.path("palette4.png"), bits=4)
        for name in ["rgb.png", "rgba.png", "gray.png", "gray_alpha.png", "bilevel.png", "palette.png",
                     "palette4.png"]:
            self.check(self.path(name))

        wide = rng.integers(0, 65536, (19, 23, 4))
        write_png(self.path("rgb16.png"), wide[..., :3], 2, 16)
        write_png(self.path("rgba16.png"), wide, 6, 16)
        write_png(self.path("gray_alpha16.png"), wide[..., :2], 4, 16)
        for name in ["rgb16.png", "rgba16.png", "gray_alpha16.png"]:
            self.check(self.path(name))
        # 16-bit gray: the high byte (Pillow's convert("RGB") of "I;16" clips to 255 instead).
        write_png(self.path("gray16.png"), wide[..., :1], 0, 16)
        with Image.open(self.path("gray16.png")) as image:
            self.assertTrue(image.mode.startswith("I"), image.mode)
            high = (np.array(image).astype(np.int64) >> 8).astype(np.uint8)
        self.check(self.path("gray16.png"), np.repeat(high[..., None], 3, axis=2))

        for depth in (1, 2, 4):
            levels = rng.integers(0, 1 << depth, (13, 11, 1))
            write_png(self.path(f"gray{depth}.png"), levels, 0, depth)
            self.check(self.path(f"gray{depth}.png"))
        # tRNS colors of gray and RGB images are ignored, as convert("RGB") ignores them.
        write_png(self.path("gray_trns.png"), rgb[..., :1], 0, 8, trns=struct.pack(">H", int(rgb[0, 0, 0])))
        write_png(self.path("rgb_trns.png"), rgb, 2, 8, trns=struct.pack(">HHH", *map(int, rgb[0, 0])))
        for name in ["gray_trns.png", "rgb_trns.png"]:
            self.check(self.path(name))

    def test_png_interlaced(self):
        rgb = photo(37, 29, 5)
        write_png(self.path("adam7.png"), rgb, 2, 8, interlace=True)
        self.check(self.path("adam7.png"), rgb)
        self.check(self.path("adam7.png"))
        indices = np.random.default_rng(6).integers(0, 16, (9, 14, 1))
        palette = np.random.default_rng(7).integers(0, 256, (16, 3))
        write_png(self.path("adam7_palette4.png"), indices, 3, 4, palette=palette, interlace=True)
        self.check(self.path("adam7_palette4.png"), palette[indices[..., 0]].astype(np.uint8))

    def test_webp(self):
        rgb = photo(66, 41, 8)
        alpha = np.random.default_rng(9).integers(0, 256, (41, 66), dtype=np.uint8)
        Image.fromarray(rgb).save(self.path("lossless.webp"), lossless=True)
        self.check(self.path("lossless.webp"), rgb)
        # The encoder may change the color of fully transparent pixels unless told to keep it.
        Image.fromarray(np.dstack([rgb, alpha]), "RGBA").save(self.path("lossless_alpha.webp"), lossless=True)
        self.check(self.path("lossless_alpha.webp"))
        Image.fromarray(np.dstack([rgb, alpha]), "RGBA").save(self.path("exact_alpha.webp"), lossless=True, exact=True)
        self.check(self.path("exact_alpha.webp"), rgb)
        Image.fromarray(rgb).save(self.path("lossy.webp"), quality=80)
        Image.fromarray(np.dstack([rgb, alpha]), "RGBA").save(self.path("lossy_alpha.webp"), quality=70)
        worst = {name: self.check(self.path(name), tolerance=LOSSY_TOLERANCE)
                 for name in ["lossy.webp", "lossy_alpha.webp"]}
        print("lossy WebP: largest difference from Pillow per file:", worst)

    def test_exif_orientation(self):
        rgb = Image.fromarray(photo(29, 17, 10))
        for orientation in range(1, 9):
            exif = Image.Exif()
            exif[0x0112] = orientation
            for name, options, tolerance in [(f"o{orientation}.png", {}, 0),
                                             (f"o{orientation}.webp", dict(lossless=True), 0),
                                             (f"o{orientation}.jpg", dict(quality=90), LOSSY_TOLERANCE)]:
                rgb.save(self.path(name), exif=exif, **options)
                with Image.open(self.path(name)) as image:
                    self.assertEqual(image.getexif().get(0x0112), orientation, name)
                self.check(self.path(name), tolerance=tolerance)
                info = json.loads(forge_ok("info", self.path(name)))
                self.assertEqual(info["orientation"], orientation, name)
                self.assertEqual((info["width"], info["height"]), (17, 29) if orientation >= 5 else (29, 17))

    def test_png_writer(self):
        rgb = photo(50, 20, 11)
        Image.fromarray(rgb).save(self.path("in.webp"), lossless=True)
        forge_ok("png", self.path("in.webp"), self.path("out.png"))
        with Image.open(self.path("out.png")) as image:
            self.assertEqual((image.format, image.mode), ("PNG", "RGB"))
            np.testing.assert_array_equal(np.array(image), rgb)

    def refused(self, path, *fragments):
        result = forge("decode", path, self.path("x.rgb"))
        self.assertEqual(result.returncode, 1, result.stderr)
        for fragment in (path,) + fragments:
            self.assertIn(fragment, result.stderr)
        info = forge("info", path)
        return result.stderr, info

    def test_refusals(self):
        rgb = Image.fromarray(photo(64, 48, 12))
        buffers = {}
        for fmt, options in [("JPEG", dict(quality=90)), ("PNG", {}), ("WEBP", dict(quality=80))]:
            buffer = io.BytesIO()
            rgb.save(buffer, fmt, **options)
            buffers[fmt] = buffer.getvalue()

        for fmt, name in [("JPEG", "cut.jpg"), ("PNG", "cut.png"), ("WEBP", "cut.webp")]:
            with open(self.path(name), "wb") as f:
                f.write(buffers[fmt][:len(buffers[fmt]) * 2 // 3])
            self.refused(self.path(name), "truncated " + {"WEBP": "WebP"}.get(fmt, fmt))

        jpeg = bytearray(buffers["JPEG"])
        sos = jpeg.index(b"\xff\xda")
        jpeg[sos + 200:sos + 202] = b"\xff\xd3"  # a restart marker in a file without restarts
        with open(self.path("marker.jpg"), "wb") as f:
            f.write(jpeg)
        self.refused(self.path("marker.jpg"), "corrupt JPEG")
        jpeg = bytearray(buffers["JPEG"])
        dht = jpeg.index(b"\xff\xc4")
        jpeg[dht + 5:dht + 21] = b"\xff" * 16  # Huffman code counts summing past 256
        with open(self.path("huffman.jpg"), "wb") as f:
            f.write(jpeg)
        self.refused(self.path("huffman.jpg"), "corrupt JPEG", "Huffman")

        jpeg = bytearray(buffers["JPEG"])
        sof = jpeg.index(b"\xff\xc0")
        jpeg[sof + 4] = 12  # sample precision 12
        with open(self.path("twelve_bit.jpg"), "wb") as f:
            f.write(jpeg)
        self.refused(self.path("twelve_bit.jpg"), "unsupported JPEG", "precision 12")
        jpeg[sof + 1], jpeg[sof + 4] = 0xC3, 8  # a lossless JPEG's frame marker
        with open(self.path("lossless.jpg"), "wb") as f:
            f.write(jpeg)
        self.refused(self.path("lossless.jpg"), "unsupported JPEG")

        # A header of 20000 x 20000 pixels: refused before any pixel is allocated.
        with open(self.path("bomb.png"), "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)) +
                    png_chunk(b"IDAT", zlib.compress(b"\0" * 100)) + png_chunk(b"IEND", b""))
        _, info = self.refused(self.path("bomb.png"), "20000x20000 = 400000000 pixels, more than forge decodes")
        self.assertEqual(info.returncode, 1)
        self.assertIn("more than forge decodes", info.stderr)

        png = bytearray(buffers["PNG"])
        idat = png.index(b"IDAT")
        length = struct.unpack(">I", png[idat - 4:idat])[0]
        data = bytearray(png[idat + 4:idat + 4 + length])
        data[2:10] = b"\xff" * 8  # a broken deflate stream, with a CRC that matches it
        png[idat + 4:idat + 4 + length] = data
        png[idat + 4 + length:idat + 8 + length] = struct.pack(">I", zlib.crc32(b"IDAT" + bytes(data)) & 0xFFFFFFFF)
        with open(self.path("deflate.png"), "wb") as f:
            f.write(png)
        self.refused(self.path("deflate.png"), "corrupt PNG")
        png = bytearray(buffers["PNG"])
        png[20] ^= 0x40  # IHDR's width, now without its CRC
        with open(self.path("crc.png"), "wb") as f:
            f.write(png)
        self.refused(self.path("crc.png"), "corrupt PNG", "CRC")

        webp = bytearray(buffers["WEBP"])
        self.assertEqual(bytes(webp[12:16] + webp[23:26]), b"VP8 \x9d\x01\x2a")
        webp[23:26] = b"\x00\x00\x00"  # the VP8 frame's start code
        with open(self.path("broken.webp"), "wb") as f:
            f.write(webp)
        self.refused(self.path("broken.webp"), "corrupt WebP")
        frames = [Image.fromarray(photo(16, 16, s)) for s in range(3)]
        frames[0].save(self.path("anim.webp"), save_all=True, append_images=frames[1:], duration=100)
        self.refused(self.path("anim.webp"), "unsupported WebP: an animation")

        rgb.save(self.path("real.gif"))
        self.refused(self.path("real.gif"), "not a JPEG, PNG or WebP image: a GIF image")
        shutil.copy(self.path("real.gif"), self.path("gif_named.png"))
        self.refused(self.path("gif_named.png"), "a GIF image")
        rgb.save(self.path("bmp.jpg"), "BMP")
        self.refused(self.path("bmp.jpg"), "a BMP image")
        with open(self.path("text.png"), "w") as f:
            f.write("just some text, no image here\n")
        self.refused(self.path("text.png"), "unknown content starting")
        open(self.path("empty.webp"), "w").close()
        self.refused(self.path("empty.webp"), "an empty file")
        self.refused(self.path("missing.png"), "cannot open")


def torchvision_size(width, height, bucket_width, bucket_height):
    """The resized size: for a square bucket torchvision's Resize(size) on a PIL image
    (shorter side to size, longer int(size * long / short)); otherwise forge's cover rule."""
    if width * bucket_height >= height * bucket_width:
        return int(bucket_height * width / height), bucket_height
    return bucket_width, int(bucket_width * height / width)


def diffusers_tensor(path, bucket_width, bucket_height, flip=False, left=None, top=None):
    """train_dreambooth_lora_flux.py's transform of one image, with torch's float32."""
    with Image.open(path) as image:
        image = ImageOps.exif_transpose(image).convert("RGB")
    width, height = torchvision_size(image.width, image.height, bucket_width, bucket_height)
    image = image.resize((width, height), Image.BILINEAR)
    if flip:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if top is None:  # CenterCrop: Python's round, halves to even
        top = int(round((height - bucket_height) / 2.0))
        left = int(round((width - bucket_width) / 2.0))
    image = image.crop((left, top, left + bucket_width, top + bucket_height))
    tensor = torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous().to(torch.float32).div(255)
    return tensor.sub(torch.tensor([0.5]).view(1, 1, 1)).div(torch.tensor([0.5]).view(1, 1, 1)).numpy()


class ResizeAndBuckets(unittest.TestCase):
    def setUp(self):
        self.dir = scratch_dir()
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def path(self, name):
        return os.path.join(self.dir, name)

    def test_resize_matches_pillow(self):
        for (w, h), sizes in [((97, 61), [(50, 30), (200, 120), (97, 30), (13, 61), (1, 1), (300, 7), (96, 60)]),
                              ((640, 480), [(682, 512), (512, 384), (160, 120), (641, 479)]),
                              ((1500, 1000), [(768, 512), (347, 231), (1499, 1001)])]:
            source = photo(w, h, w + h)
            Image.fromarray(source).save(self.path("source.png"))
            for size in sizes:
                forge_ok("resize", self.path("source.png"), *size, self.path("resized.rgb"))
                actual = np.fromfile(self.path("resized.rgb"), np.uint8).reshape(size[1], size[0], 3)
                expected = np.array(Image.fromarray(source).resize(size, Image.BILINEAR))
                diff = np.abs(actual.astype(int) - expected.astype(int))
                self.assertLessEqual(int(diff.max()), 1, f"{w}x{h} -> {size}")
                self.assertEqual(int((diff > 0).sum()), 0, f"{w}x{h} -> {size}: not byte for byte")

    def forge_tensor(self, path, bucket, crop="center", flip=0, seed=0, index=0):
        out = self.path("tensor.f32")
        placement = json.loads(forge_ok("bucket", path, *bucket, crop, flip, seed, index, out))
        return np.fromfile(out, np.float32).reshape(3, bucket[1], bucket[0]), placement

    def test_center_crop_tensor_is_diffusers_bit_for_bit(self):
        for (w, h), bucket in [((640, 480), (512, 512)), ((481, 641), (512, 512)), ((300, 300), (256, 256)),
                               ((1000, 700), (832, 1216)), ((1200, 500), (1216, 832)), ((200, 150), (512, 512))]:
            Image.fromarray(photo(w, h, w * 3 + h)).save(self.path("image.png"))
            actual, placement = self.forge_tensor(self.path("image.png"), bucket)
            expected = diffusers_tensor(self.path("image.png"), *bucket)
            self.assertEqual((placement["resized_width"], placement["resized_height"]),
                             torchvision_size(w, h, *bucket))
            np.testing.assert_array_equal(actual, expected, f"{w}x{h} in {bucket}")
        # An EXIF-rotated JPEG: upright first, as exif_transpose does.
        exif = Image.Exif()
        exif[0x0112] = 6
        Image.fromarray(photo(400, 300, 13)).save(self.path("rotated.jpg"), exif=exif, quality=95)
        actual, placement = self.forge_tensor(self.path("rotated.jpg"), (256, 256))
        self.assertEqual((placement["resized_width"], placement["resized_height"]), (256, 341))
        expected = diffusers_tensor(self.path("rotated.jpg"), 256, 256)
        self.assertLessEqual(float(np.abs(actual - expected).max()), LOSSY_TOLERANCE * 2 / 255 + 1e-6)

    def test_random_crop_and_flip_are_the_placement_forge_reports(self):
        Image.fromarray(photo(700, 400, 14)).save(self.path("image.png"))
        flips = set()
        for index in range(12):
            actual, p = self.forge_tensor(self.path("image.png"), (256, 256), "random", 1, 7, index)
            self.assertTrue(0 <= p["left"] <= p["resized_width"] - 256 and p["top"] == 0, p)
            expected = diffusers_tensor(self.path("image.png"), 256, 256, p["flip"], p["left"], p["top"])
            np.testing.assert_array_equal(actual, expected, f"index {index}: {p}")
            flips.add(p["flip"])
        self.assertEqual(flips, {True, False})


def process_cc12m_image(img, output_size, skip_low_resolution, offset):
    """torchtitan's _process_cc12m_image (experiments/flux/dataset/flux_dataset.py), restated
    with the crop offset given instead of drawn from torch.randint."""
    width, height = img.size
    if skip_low_resolution and (width < output_size or height < output_size):
        return None
    if width >= height:
        new_width, new_height = math.ceil(output_size / height * width), output_size
        img = img.resize((new_width, new_height))
        assert 0 <= offset <= new_width - output_size
        resized_img = img.crop((offset, 0, offset + output_size, output_size))
    else:
        new_width, new_height = output_size, math.ceil(output_size / width * height)
        img = img.resize((new_width, new_height))
        assert 0 <= offset <= new_height - output_size
        resized_img = img.crop((0, offset, output_size, offset + output_size))
    if resized_img.mode != "RGB":
        resized_img = resized_img.convert("RGB")
    np_img = np.array(resized_img).transpose((2, 0, 1))
    return (torch.tensor(np_img).float() / 255.0 * 2.0 - 1.0).numpy()


class TorchtitanTransform(unittest.TestCase):
    def setUp(self):
        self.dir = scratch_dir()
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def path(self, name):
        return os.path.join(self.dir, name)

    def test_default_resample_is_bicubic(self):
        image = Image.fromarray(photo(40, 30, 1))
        for mode in ("RGB", "L", "RGBA"):
            one = image.convert(mode)
            self.assertEqual(one.resize((23, 17)).tobytes(), one.resize((23, 17), Image.BICUBIC).tobytes(), mode)

    def test_bicubic_resize_matches_pillow(self):
        rng = np.random.default_rng(5)
        cases = 0
        orders = set()
        for source_index in range(6):
            w, h = (int(v) for v in rng.integers(2, 700, 2))
            source = photo(w, h, source_index)
            Image.fromarray(source).save(self.path("source.png"))
            sizes = [(int(rng.integers(1, 2 * w)), int(rng.integers(1, 2 * h))) for _ in range(8)]
            sizes += [(w, max(1, h // 3)), (max(1, w - 1), max(1, h // 4)), (w * 2 + 1, h), (w, h)]
            for size in sizes:
                forge_ok("resize", self.path("source.png"), *size, self.path("resized.rgb"), "bicubic")
                actual = np.fromfile(self.path("resized.rgb"), np.uint8).reshape(size[1], size[0], 3)
                expected = np.array(Image.fromarray(source).resize(size, Image.BICUBIC))
                diff = np.abs(actual.astype(int) - expected.astype(int))
                self.assertEqual(int((diff > 0).sum()), 0,
                                 f"{w}x{h} -> {size}: {int((diff > 0).sum())} bytes differ, by {int(diff.max())}")
                shrink_y, shrink_x = h - size[1], w - size[0]
                orders.add(shrink_y > 0 and shrink_y > 2 * shrink_x)
                cases += 1
        self.assertEqual(orders, {True, False})  # both pass orders ran
        self.assertGreaterEqual(cases, 70)

    def forge_torchtitan(self, path, size=256, min_size=0, seed=0, index=0):
        out = self.path("tensor.f32")
        if os.path.exists(out):
            os.remove(out)
        placement = json.loads(forge_ok("torchtitan", path, size, min_size, seed, index, out))
        if placement["skipped"]:
            self.assertFalse(os.path.exists(out))
            return None, placement
        return np.fromfile(out, np.float32).reshape(3, size, size), placement

    def test_transform_is_the_reference_bit_for_bit(self):
        images = [((640, 480), "RGB"), ((481, 641), "RGB"), ((300, 300), "RGB"), ((273, 182), "RGB"),
                  ((182, 273), "L"), ((1000, 257), "L"), ((400, 700), "RGBA"), ((256, 256), "RGB")]
        offsets = set()
        for (w, h), mode in images:
            pixels = photo(w, h, w + 7 * h)
            image = Image.fromarray(pixels).convert(mode)
            image.save(self.path("image.png"))
            for index in range(3):
                actual, p = self.forge_torchtitan(self.path("image.png"), 256, 0, 11, index)
                wide = w >= h
                offset = p["left"] if wide else p["top"]
                self.assertEqual(p["top" if wide else "left"], 0, p)
                self.assertEqual((p["resized_width"], p["resized_height"]),
                                 (math.ceil(256 / h * w), 256) if wide else (256, math.ceil(256 / w * h)))
                with Image.open(self.path("image.png")) as reopened:
                    self.assertEqual(reopened.mode, mode)
                    expected = process_cc12m_image(reopened, 256, False, offset)
                np.testing.assert_array_equal(actual, expected, f"{w}x{h} {mode}, index {index}: {p}")
                offsets.add((w, h, offset))
        self.assertGreater(len(offsets), 12)  # the offsets vary with the index

    def test_min_size_skips_and_validation_keeps_small_images(self):
        Image.fromarray(photo(300, 200, 3)).save(self.path("small.png"))
        actual, p = self.forge_torchtitan(self.path("small.png"), 256, 256)
        self.assertTrue(p["skipped"])
        # COCO validation: skip_low_resolution=False, the image is enlarged.
        actual, p = self.forge_torchtitan(self.path("small.png"), 256, 0, 3, 1)
        self.assertEqual((p["resized_width"], p["resized_height"]), (384, 256))
        with Image.open(self.path("small.png")) as image:
            self.assertIsNone(process_cc12m_image(image, 256, True, 0))
            expected = process_cc12m_image(image, 256, False, p["left"])
        np.testing.assert_array_equal(actual, expected)


def dataset(*args):
    return forge("dataset", *args)


def entries_of(stdout):
    lines = [json.loads(line) for line in stdout.splitlines()]
    return lines[:-1], lines[-1]


class Datasets(unittest.TestCase):
    def setUp(self):
        self.dir = scratch_dir()
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def file(self, relative, content=None, image=None, fmt=None):
        path = os.path.join(self.dir, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if image is not None:
            Image.fromarray(image).save(path, fmt)
        else:
            with open(path, "wb" if isinstance(content, bytes) else "w") as f:
                f.write(content)
        return path

    def refusal(self, *args):
        result = dataset(*args)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        return result.stderr

    def test_caption_files(self):
        root = os.path.join(self.dir, "set")
        self.file("set/b.png", image=photo(30, 20, 1))
        self.file("set/b.txt", "\ufeff  a red fox in the snow \n")
        self.file("set/sub/a.jpg", image=photo(20, 30, 2))
        self.file("set/sub/a.txt", "a city at night")
        self.file("set/sub/deeper/c.webp", image=photo(16, 16, 3))
        self.file("set/sub/deeper/c.txt", "a bowl of fruit\r\n")
        self.file("set/orphan.txt", "a caption without its image")
        self.file("set/notes.md", "# not an image")
        self.file("set/.cache/huggingface/skipped.png", image=photo(8, 8, 4))
        self.file("set/.hidden.png", image=photo(8, 8, 4))
        entries, summary = entries_of(forge_ok("dataset", "caption-files", root))
        self.assertEqual([(os.path.relpath(e["image"], root), e["caption"], e["format"], e["width"], e["height"])
                          for e in entries],
                         [("b.png", "a red fox in the snow", "PNG", 30, 20),
                          ("sub/a.jpg", "a city at night", "JPEG", 20, 30),
                          ("sub/deeper/c.webp", "a bowl of fruit", "WebP", 16, 16)])
        self.assertEqual(summary["captions_without_image"], 1)
        self.assertIn("3 images with captions (caption-files: 1 JPEG, 1 PNG, 1 WebP); 1 caption file without an image",
                      summary["summary"])

        self.file("set/z_uncaptioned.png", image=photo(8, 8, 5))
        error = self.refusal("caption-files", root)
        self.assertIn("1 problem in the caption-files image dataset", error)
        self.assertIn("z_uncaptioned.png: no caption file", error)
        entries, summary = entries_of(forge_ok("dataset", "caption-files", root, "skip"))
        self.assertEqual(len(entries), 3)
        self.assertEqual(summary["skipped_without_caption"], 1)
        self.assertIn("1 skipped without a caption (z_uncaptioned.png)", summary["summary"])

        self.file("set/empty.png", image=photo(8, 8, 6))
        self.file("set/empty.txt", " \n\t")
        self.file("set/latin1.png", image=photo(8, 8, 7))
        self.file("set/latin1.txt", "caf\xe9".encode("latin-1"))
        self.file("set/broken.jpg", b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01" + b"\x00" * 40)
        self.file("set/broken.txt", "x")
        self.file("set/anim.gif", image=photo(8, 8, 8), fmt="GIF")
        self.file("set/anim.txt", "x")
        cut = self.file("set/cut.png", image=photo(40, 40, 9))
        with open(cut, "r+b") as f:
            f.truncate(os.path.getsize(cut) // 2)
        self.file("set/cut.txt", "x")
        error = self.refusal("caption-files", root, "skip")
        self.assertIn("4 problems in the caption-files image dataset", error)
        for fragment in ["empty.txt: empty caption", "latin1.txt: caption: invalid UTF-8 at byte offset 3",
                         "broken.jpg: truncated JPEG", "anim.gif: not a JPEG, PNG or WebP image: a GIF image"]:
            self.assertIn(fragment, error)
        self.assertIn("3 problems", self.refusal("caption-files", root, "skip", "allow-empty"))
        # cut.png's header is whole: its missing image data shows when the pixels are decoded.
        for name in ["latin1", "broken", "anim"]:
            os.remove(os.path.join(root, name + ".txt"))
        error = self.refusal("caption-files", root, "skip", "allow-empty", "verify")
        self.assertIn("1 problem in the caption-files image dataset", error)
        self.assertIn("cut.png: truncated PNG", error)

    def test_filename_captions_as_pseudo_camera_10k(self):
        # bghira/pseudo-camera-10k as huggingface-cli download --local-dir leaves it: images in
        # train/, the same captions as text in caption/ (scripts/khoya.sh), metadata in .cache/.
        root = os.path.join(self.dir, "pseudo-camera-10k")
        names = ["a_bird_perches_on_a_thin_branch_amidst_a_backdrop_of_blurred_trees",
                 "the_ocean_at_dawn_with_waves_crashing_on_dark_rocks", "a_cup_of_coffee_on_a_wooden_table"]
        for i, name in enumerate(names):
            self.file(f"pseudo-camera-10k/train/{name}.png", image=photo(40 + i, 30, i))
            self.file(f"pseudo-camera-10k/caption/{name}.txt", name.replace("_", " ") + "\n")
        self.file("pseudo-camera-10k/README.md", "---\nlicense: cc\n---\n")
        self.file("pseudo-camera-10k/scripts/khoya.sh", "#!/bin/bash\n")
        self.file("pseudo-camera-10k/.gitattributes", "*.png filter=lfs\n")
        self.file("pseudo-camera-10k/.cache/huggingface/download/train/x.png.metadata", "abc\n")
        # The Hugging Face cache's snapshot folders hold symbolic links to blobs.
        blob = self.file("blobs/0123abcd", image=photo(24, 24, 9), fmt="PNG")
        os.symlink(blob, os.path.join(root, "train", "a_linked_image_of_a_forest.png"))
        entries, summary = entries_of(forge_ok("dataset", "filename-captions", root))
        images = sorted([f"train/{n}.png" for n in names] + ["train/a_linked_image_of_a_forest.png"])
        self.assertEqual([os.path.relpath(e["image"], root) for e in entries], images)
        for e in entries:
            # FluxBenchmark's tokenize_captions: the name without extension, '_' -> ' '
            self.assertEqual(e["caption"], os.path.splitext(os.path.basename(e["image"]))[0].replace("_", " "))
            caption_file = os.path.join(root, "caption", os.path.basename(e["image"])[:-4] + ".txt")
            if os.path.exists(caption_file):
                with open(caption_file) as f:
                    self.assertEqual(e["caption"], f.read().strip())
        self.assertIn("4 images with captions (filename-captions: 4 PNG)", summary["summary"])

        self.file("pseudo-camera-10k/train/not_really_a_png.png", "<html>rate limited</html>")
        self.assertIn("not_really_a_png.png: not a JPEG, PNG or WebP image: an HTML page",
                      self.refusal("filename-captions", root))
        self.assertIn("not a folder", self.refusal("filename-captions", blob))

    def test_jsonl_manifest(self):
        self.file("data/images/a.png", image=photo(20, 10, 1))
        self.file("data/b.jpg", image=photo(10, 20, 2))
        absolute = self.file("elsewhere/c.webp", image=photo(12, 12, 3))
        lines = [json.dumps({"image": "images/a.png", "text": "first", "width": 20}),
                 "",
                 json.dumps({"file_name": "b.jpg", "caption": "second, from an imagefolder metadata.jsonl"}),
                 json.dumps({"image": absolute, "text": "third"})]
        manifest = self.file("data/manifest.jsonl", "\n".join(lines) + "\n")
        entries, summary = entries_of(forge_ok("dataset", "jsonl", manifest))
        self.assertEqual([(e["image"], e["caption"]) for e in entries],
                         [(os.path.join(self.dir, "data", "images/a.png"), "first"),
                          (os.path.join(self.dir, "data", "b.jpg"), "second, from an imagefolder metadata.jsonl"),
                          (absolute, "third")])
        self.assertIn("3 images with captions (jsonl: 1 JPEG, 1 PNG, 1 WebP)", summary["summary"])

        bad = lines + ['{"image": "images/a.png", "text": "unterminated',
                       json.dumps({"image": "missing.png", "text": "gone"}),
                       json.dumps({"image": 5, "text": "number"}),
                       json.dumps({"image": "images/a.png", "file_name": "b.jpg", "text": "both"}),
                       json.dumps({"image": "images/a.png", "text": ""}),
                       json.dumps([1, 2]),
                       json.dumps({"image": "b.jpg"})]
        manifest = self.file("data/bad.jsonl", "\n".join(bad) + "\n")
        error = self.refusal("jsonl", manifest)
        self.assertIn("7 problems in the jsonl image dataset", error)
        for fragment in [f"{manifest}:5: not valid JSON", f"{manifest}:6: ", "missing.png: cannot open",
                         f"{manifest}:7: \"image\" is number, expected a string", f"{manifest}:8: both",
                         f"{manifest}:9 \"text\": empty caption", f"{manifest}:10: array, expected an object",
                         f"{manifest}:11: no caption"]:
            self.assertIn(fragment, error)
        skipped = bad[:5] + bad[10:]
        manifest = self.file("data/skip.jsonl", "\n".join(skipped) + "\n")
        self.assertIn("1 problem", self.refusal("jsonl", manifest, "skip"))  # the bad JSON stays an error
        manifest = self.file("data/skip2.jsonl", "\n".join(lines + bad[10:]) + "\n")
        entries, summary = entries_of(forge_ok("dataset", "jsonl", manifest, "skip"))
        self.assertEqual((len(entries), summary["skipped_without_caption"]), (3, 1))
        self.assertIn("unknown image dataset layout 'csv'", self.refusal("csv", manifest))


if __name__ == "__main__":
    unittest.main()
