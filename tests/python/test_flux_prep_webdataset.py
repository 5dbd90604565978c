"""forge prep --images on webdataset tar shards (NOTE [Image-caption datasets], NOTE [Tar
archives]) against the same images in a caption-files folder: shards written by Python's
tarfile in its PAX, GNU and ustar formats (a 150-character key through a pax path record
and through a GNU long name, a ustar prefix, a folder entry, json members beside the
images, PNG and JPEG) go through `forge prep --images` with a brace pattern, a folder of
shards and one shard; every cache must equal the caption-files folder's row for row (same
pixels, captions and order; the tiny random T5 and CLIP of test_flux_prep_vs_diffusers,
--vae pixels). Also the refusals: a missing shard named, a symbolic link member and a
damaged header named with their shard and byte offset, a pattern with a non-webdataset
layout."""
import io
import json
import os
import subprocess
import sys
import tarfile
import unittest

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(__file__))
from forge_test_util import forge_bin, scratch_dir  # noqa: E402
from test_flux_prep_vs_diffusers import make_pipeline  # noqa: E402

LONG = "k" * 143  # with "000002_" a 150-character key
DEEP = "d" * 60 + "/" + "e" * 50  # a member path past 100 characters: a ustar prefix
# (key, image extension, width, height, caption) in archive order, which is also the
# caption-files folder's byte order of paths.
SAMPLES = [
    ("000001", "png", 40, 24, "a red circle on a blue background"),
    ("000002_" + LONG, "jpg", 32, 32, "  Two green squares, one small and one LARGE!\n"),
    ("000003", "png", 24, 48, "café naïve 漢字 and emoji 😀"),
    ("000004_" + LONG, "png", 33, 31, "a key through a GNU long name"),
    ("000005", "jpg", 50, 30, "word " * 40),
    (DEEP + "/000006", "png", 36, 20, "in a folder, through a ustar prefix"),
]
SHARDS = [("data-0000.tar", tarfile.PAX_FORMAT, SAMPLES[0:3]), ("data-0001.tar", tarfile.GNU_FORMAT, SAMPLES[3:5]),
          ("data-0002.tar", tarfile.USTAR_FORMAT, SAMPLES[5:6])]


def image_bytes(ext, w, h, seed):
    pixels = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG" if ext == "jpg" else "PNG", quality=90)
    return out.getvalue()


def add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 1700000000
    tar.addfile(info, io.BytesIO(data))


def make_dataset(root):
    """The shards under ROOT/shards and the same samples as ROOT/folder (caption-files)."""
    shards, folder = os.path.join(root, "shards"), os.path.join(root, "folder")
    os.makedirs(shards)
    for seed, (key, ext, w, h, caption) in enumerate(SAMPLES):
        path = os.path.join(folder, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.{ext}", "wb") as f:
            f.write(image_bytes(ext, w, h, seed))
        with open(f"{path}.txt", "w", encoding="utf-8") as f:
            f.write(caption)
    for name, fmt, samples in SHARDS:
        with tarfile.open(os.path.join(shards, name), "w", format=fmt) as tar:
            for key, ext, _, _, caption in samples:
                if "/" in key:
                    directory = tarfile.TarInfo(os.path.dirname(key))
                    directory.type = tarfile.DIRTYPE
                    tar.addfile(directory)
                add(tar, key + ".json", json.dumps({"key": key}).encode())
                with open(os.path.join(folder, f"{key}.{ext}"), "rb") as f:
                    add(tar, f"{key}.{ext}", f.read())
                add(tar, key + ".txt", caption.encode("utf-8"))
    return shards, folder


def forge(*args):
    return subprocess.run([forge_bin(), "prep", *args], capture_output=True, text=True, timeout=300)


def read_cache(folder):
    """[(image, caption, latents, prompt_embeds, pooled)] in captions.jsonl's order."""
    from safetensors.numpy import load_file

    with open(os.path.join(folder, "cache.json")) as f:
        manifest = json.load(f)
    shards = [load_file(os.path.join(folder, s["file"])) for s in manifest["shards"]]
    rows = []
    with open(os.path.join(folder, "captions.jsonl"), encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            shard = shards[row["shard"]]
            rows.append((row["image"], row["caption"],
                         *(shard[k][row["row"]] for k in ("latents", "prompt_embeds", "pooled_prompt_embeds"))))
    return rows


class FluxPrepWebdataset(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = scratch_dir()
        cls.pipeline = os.path.join(cls.root, "pipeline")
        make_pipeline(cls.pipeline)
        cls.shards, cls.folder = make_dataset(cls.root)
        cls.reference = cls.prep(cls, "reference", cls.folder)
        cls.expected = read_cache(cls.reference)

    def out(self, name):
        return os.path.join(self.root, name)

    def prep(self, name, images, *args):
        path = os.path.join(self.root, name)
        result = forge("--images", images, "--output", path, "--pipeline", self.pipeline, "--vae", "pixels",
                       "--resolution", "32", "--dtype", "fp32", "--text-tokens", "24", "--batch-size", "2",
                       "--shard-samples", "4", *args)
        if result.returncode != 0:
            raise AssertionError(f"forge prep --images {images} failed:\n{result.stdout}\n{result.stderr}")
        return path

    def assert_same_as_folder(self, cache, shard_of):
        """The cache at CACHE holds the reference's rows; SHARD_OF(key) is the shard file."""
        rows = read_cache(cache)
        self.assertEqual(len(rows), len(SAMPLES))
        for row, want, (key, ext, _, _, caption) in zip(rows, self.expected, SAMPLES):
            self.assertEqual(row[0], f"{shard_of(key)}:{key}.{ext}")
            self.assertEqual(want[0], os.path.join(self.folder, f"{key}.{ext}"))
            self.assertEqual(row[1], caption.strip())
            self.assertEqual(row[1], want[1])
            for got, expected, kind in zip(row[2:], want[2:], ("latents", "prompt_embeds", "pooled")):
                np.testing.assert_array_equal(got, expected, err_msg=f"{key} {kind}")

    def shard_path(self, key):
        index = next(i for i, (_, _, samples) in enumerate(SHARDS) if any(s[0] == key for s in samples))
        return os.path.join(self.shards, SHARDS[index][0])

    def test_tarfile_formats(self):
        # The formats store the long keys as this test means them to.
        with tarfile.open(os.path.join(self.shards, "data-0000.tar")) as tar:
            self.assertEqual(len(SAMPLES[1][0]), 150)
            self.assertIn(SAMPLES[1][0] + ".jpg", tar.getnames())
        with open(os.path.join(self.shards, "data-0001.tar"), "rb") as f:
            self.assertIn(b"././@LongLink", f.read(512))
        with open(os.path.join(self.shards, "data-0000.tar"), "rb") as f:
            self.assertIn(b"path=" + SAMPLES[1][0].encode(), f.read())

    def test_brace_pattern_matches_caption_files(self):
        pattern = os.path.join(self.shards, "data-{0000..0002}.tar")
        result = forge("--images", pattern, "--output", self.out("pattern"), "--pipeline", self.pipeline, "--vae",
                       "pixels", "--resolution", "32", "--dtype", "fp32", "--text-tokens", "24", "--batch-size", "2",
                       "--shard-samples", "4")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("6 images with captions (webdataset, 3 shards: 2 JPEG, 4 PNG)", result.stdout + result.stderr)
        self.assert_same_as_folder(self.out("pattern"), self.shard_path)
        with open(os.path.join(self.out("pattern"), "cache.json")) as f:
            self.assertEqual(json.load(f)["source"]["layout"], "webdataset")

    def test_shard_folder_and_one_shard(self):
        cache = self.prep("folder-of-shards", self.shards, "--layout", "webdataset")
        self.assert_same_as_folder(cache, self.shard_path)
        one = os.path.join(self.shards, "data-0001.tar")
        rows = read_cache(self.prep("one-shard", one))
        self.assertEqual([r[0] for r in rows], [f"{one}:{k}.{e}" for k, e, *_ in SAMPLES[3:5]])
        for row, want in zip(rows, self.expected[3:5]):
            np.testing.assert_array_equal(row[2], want[2])

    def test_refusals(self):
        bad = self.out("bad-shards")
        os.makedirs(bad)
        with tarfile.open(os.path.join(bad, "link.tar"), "w", format=tarfile.PAX_FORMAT) as tar:
            add(tar, "a.txt", b"caption")
            link = tarfile.TarInfo("a.png")
            link.type = tarfile.SYMTYPE
            link.linkname = "/etc/passwd"
            tar.addfile(link)
        with open(os.path.join(self.shards, "data-0000.tar"), "rb") as f:
            damaged = bytearray(f.read())
        damaged[1024 + 3] ^= 0x20  # in the second header (the first member's data is 1 block)
        with open(os.path.join(bad, "damaged.tar"), "wb") as f:
            f.write(damaged)
        with open(os.path.join(bad, "cut.tar"), "wb") as f, open(os.path.join(self.shards, "data-0000.tar"), "rb") as g:
            f.write(g.read()[:1024 + 300])
        common = ("--output", self.out("x"), "--pipeline", self.pipeline, "--vae", "pixels", "--resolution", "32")
        cases = [
            ((os.path.join(self.shards, "data-{0000..0004}.tar"),),
             ["2 of the 5 tar shards it names are missing", os.path.join(self.shards, "data-0003.tar"),
              os.path.join(self.shards, "data-0004.tar")]),
            ((os.path.join(bad, "link.tar"),),
             [os.path.join(bad, "link.tar") + ": tar header at byte offset 1024: member 'a.png' is a symbolic link"]),
            ((os.path.join(bad, "damaged.tar"),),
             [os.path.join(bad, "damaged.tar") + ": tar header at byte offset 1024: checksum"]),
            ((os.path.join(bad, "cut.tar"),),
             [os.path.join(bad, "cut.tar") + ": tar header at byte offset 1024: a header cut short (300 bytes left"]),
            ((os.path.join(self.shards, "data-{0000..0002}.tar"), "--layout", "caption-files"),
             ["a brace pattern names tar shards, which --layout webdataset reads"]),
            ((os.path.join(self.shards, "data-{0000..00x2}.tar"),), ["is not of two decimal numbers"]),
            ((self.folder, "--layout", "webdataset"), ["no .tar shards directly in this folder"]),
        ]
        for args, fragments in cases:
            with self.subTest(args=args):
                result = forge("--images", *args, *common)
                self.assertNotEqual(result.returncode, 0)
                for fragment in fragments:
                    self.assertIn(fragment, result.stdout + result.stderr)
        self.assertFalse(os.path.exists(self.out("x")))


if __name__ == "__main__":
    unittest.main()
