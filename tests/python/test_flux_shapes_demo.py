"""The coloured-shapes demonstration's machinery on the CPU, in seconds (scripts/flux_shapes.py
and scripts/flux_shapes_demo.py; README, FLUX.1): the images and their captions, the
classifier on the ground truth, and the whole chain — tiny encoders, forge prep --images
with pixel latents, forge train on the caches with the validation loss, forge sample, the
grid and summary — for a few steps. Whether the model learns the shapes is measured on a
GPU (scripts/gpu-flux), where thousands of steps take seconds."""
import json
import os
import sys
import unittest

from forge_test_util import forge_bin, scratch_dir, source_dir

sys.path.insert(0, os.path.join(source_dir(), "scripts"))
import flux_shapes  # noqa: E402
import flux_shapes_demo  # noqa: E402


class FluxShapesDemo(unittest.TestCase):
    def test_images_and_the_classifier(self):
        folder = os.path.join(scratch_dir(), "images")
        captions = flux_shapes.make_dataset(folder, per_class=6, seed=3)
        self.assertEqual(len(captions), 9)
        pngs = sorted(f for f in os.listdir(folder) if f.endswith(".png"))
        self.assertEqual(len(pngs), 54)
        for name in pngs:
            colour, shape, _ = name.split("-")
            with open(os.path.join(folder, name[:-4] + ".txt")) as f:
                self.assertEqual(f.read().strip(), f"a {colour} {shape}")
            image = flux_shapes.read_png(os.path.join(folder, name))
            self.assertEqual((len(image), len(image[0])), (32, 32))
            self.assertEqual(flux_shapes.classify(image), (colour, shape), name)
        self.assertEqual(flux_shapes.classify([[(255, 255, 255)] * 4] * 4), (None, None))

    def test_the_chain_runs_for_a_few_steps(self):
        out = os.path.join(scratch_dir(), "demo")
        summary = flux_shapes_demo.main(["--out", out, "--forge", forge_bin(), "--steps", "2", "--per-class", "4",
                                         "--images-per-caption", "1", "--sample-steps", "2"])
        self.assertEqual(summary["samples"], 9)
        self.assertEqual(len(summary["validation_losses"]), 1)  # after the last step
        self.assertTrue(0 < summary["last_loss"] < 10, summary)
        with open(os.path.join(out, "summary.json")) as f:
            self.assertEqual(json.load(f)["samples"], 9)
        grid = flux_shapes.read_png(os.path.join(out, "samples-grid.png"))
        self.assertEqual(len(grid), 9 * 34 + 2)
        with self.assertRaises(SystemExit):  # an existing --out is refused
            flux_shapes_demo.main(["--out", out, "--forge", forge_bin()])


if __name__ == "__main__":
    unittest.main()
