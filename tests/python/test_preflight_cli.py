"""forge preflight from the command line where no GPU runs it: a build without the CUDA
backend (CI) or a machine without a visible GPU must say why and exit non-zero, never
report a pass."""
import subprocess
import unittest

from forge_test_util import forge_bin


class PreflightWithoutGpu(unittest.TestCase):
    def test_exits_non_zero_and_says_why(self):
        result = subprocess.run([forge_bin(), "preflight", "--json", "/nonexistent/never-written.json"],
                                capture_output=True, text=True)
        if result.stdout.startswith("forge preflight on"):
            self.skipTest("this machine has a GPU: preflight ran (tests/gpu covers it)")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("forge preflight", result.stderr)
        self.assertTrue("no CUDA backend" in result.stderr or "GPU" in result.stderr, result.stderr)


if __name__ == "__main__":
    unittest.main()
