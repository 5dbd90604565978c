"""forge report's page in a real browser: headless Chromium (Debian package chromium,
installed by scripts/install-deps) renders it to a screenshot, which must show the page:
mostly white, with the table text and each run's chart color present. Pillow, which
tensorboard depends on, reads the PNG. Without chromium (Ubuntu ships it only as a snap)
the test exits 77, which CTest reports as skipped."""
import os
import shutil
import subprocess
import sys
import unittest

import numpy as np
from PIL import Image

from forge_test_util import forge_bin, run, scratch_dir, tool

WIDTH, HEIGHT = 1400, 2000
# The first two colors of the report's palette (src/bench/report_html.cpp).
RUN_COLORS = [(0x1F, 0x77, 0xB4), (0xE8, 0x71, 0x0A)]


def pixels_near(pixels, color, tolerance=40):
    return int((np.abs(pixels - np.array(color)).sum(axis=2) <= tolerance).sum())


CHROMIUM = shutil.which("chromium")
SKIPPED = 77


class RenderInChromium(unittest.TestCase):
    def test_screenshot_shows_the_report(self):
        root = scratch_dir()
        tiny, synthetic = os.path.join(root, "tiny"), os.path.join(root, "synthetic")
        run([forge_bin(), "train", "--training.steps", "30", "--eval.interval", "10", "--logging.run_dir", tiny])
        run([tool("forge_write_metrics"), synthetic, "30"])
        page = os.path.join(root, "report.html")
        run([forge_bin(), "report", tiny, synthetic, "--output", page])

        screenshot = os.path.join(root, "report.png")
        subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={os.path.join(root, 'profile')}", f"--screenshot={screenshot}",
                        f"--window-size={WIDTH},{HEIGHT}", f"file://{page}"],
                       capture_output=True, text=True, timeout=180)
        self.assertTrue(os.path.isfile(screenshot), "chromium wrote no screenshot")
        image = Image.open(screenshot).convert("RGB")
        self.assertEqual(image.size, (WIDTH, HEIGHT))
        pixels = np.asarray(image, dtype=np.int32)
        total = WIDTH * HEIGHT
        white = pixels_near(pixels, (255, 255, 255), 12)
        dark = int((pixels.sum(axis=2) < 384).sum())  # text
        print(f"white {white / total:.1%}, dark {dark / total:.2%}, "
              f"run colors {[pixels_near(pixels, c) for c in RUN_COLORS]}")
        self.assertGreater(white / total, 0.5, "the page is not mostly white")
        self.assertGreater(dark / total, 0.003, "no text rendered")
        for color in RUN_COLORS:
            self.assertGreater(pixels_near(pixels, color), 400, f"no chart line of color {color}")


if __name__ == "__main__":
    if CHROMIUM is None:
        print("skipped: chromium not found (on Debian, scripts/install-deps installs the chromium package)")
        sys.exit(SKIPPED)
    unittest.main()
