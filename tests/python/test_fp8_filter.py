"""precision.fp8_filter_fqns through forge train on CPU ranks (NOTE [FP8 filter] in
src/model/fp8_projections.h): a delayed run with the first block kept out of FP8 logs what it
keeps, trains, and its checkpoint records the filter and the histories of the projections it
trains in FP8 alone (6 of debug-tiny's 8); resumed under a wider filter it keeps those
histories by name and goes on; resumed under no filter it is refused, naming the key and the
projection that would start with no history, with a non-zero exit and the checkpoint left as
it was; and under FSDP on 2 ranks the FP8 all-gather (the filtered projections travelling with
the norms) is bitwise the compute-dtype gather of the same filtered run, ZeRO-3 and ZeRO-1."""
import json
import os
import shutil
import unittest

from test_fp8_fsdp import train
from forge_test_util import scratch_dir, train_losses

DELAYED = ["--precision.fp8", "delayed", "--precision.fp8_amax_history_len", "8"]
SAVE = ["--checkpoint.enable", "true", "--checkpoint.interval", "4"]
FIRST_BLOCK = ["--precision.fp8_filter_fqns", "layers.0."]


def metadata(run_dir, step):
    with open(os.path.join(run_dir, "checkpoints", f"step-{step}", "metadata.json")) as f:
        return json.load(f)


class Fp8Filter(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()
        cls.filtered = os.path.join(cls.tmp, "filtered")
        cls.result = train(cls.filtered, 1, *DELAYED, *SAVE, *FIRST_BLOCK)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_the_run_logs_trains_and_checkpoints_the_filter(self):
        self.assertIn("precision.fp8_filter_fqns 'layers.0.' keeps 4 of the 8 block projections in the compute "
                      "dtype: layers.0.attention.qkv.weight", self.result.stdout)
        losses = train_losses(self.filtered)
        self.assertLess(losses[-1], losses[0] - 0.5)
        state = metadata(self.filtered, 4)["fp8_delayed"]
        self.assertEqual(state["filter_fqns"], ["layers.0."])
        self.assertEqual(len(state["scales"]), 4 * 3)  # block 1's four projections x (x, W, dy)
        self.assertEqual(len(state["histories"]), 4 * 3 * 8)

    def test_a_resume_keeps_the_histories_by_name_and_refuses_a_missing_one(self):
        wider = os.path.join(self.tmp, "wider")
        shutil.copytree(self.filtered, wider)
        result = train(wider, 1, *DELAYED, *SAVE, "--precision.fp8_filter_fqns", "layers.0.,mlp.down",
                       "--checkpoint.load_step", "8")
        self.assertIn("resuming from checkpoint", result.stdout + result.stderr)
        self.assertEqual(metadata(wider, 12)["fp8_delayed"]["filter_fqns"], ["layers.0.", "mlp.down"])
        self.assertEqual(len(metadata(wider, 12)["fp8_delayed"]["scales"]), 3 * 3)

        unfiltered = os.path.join(self.tmp, "unfiltered")
        shutil.copytree(self.filtered, unfiltered)
        saved = os.path.join(unfiltered, "checkpoints", "step-8", "metadata.json")
        with open(saved) as f:
            before = f.read()
        refused = train(unfiltered, 1, *DELAYED, *SAVE, "--checkpoint.load_step", "8", check=False)
        self.assertNotEqual(refused.returncode, 0)
        for words in ("its FP8 delayed-scaling state does not fit this run",
                      "saved with precision.fp8_filter_fqns 'layers.0.'", "'layers.0.attention.qkv.weight'",
                      "resume with a filter that keeps it out of FP8 too"):
            self.assertIn(words, refused.stderr)
        with open(saved) as f:
            self.assertEqual(f.read(), before)

    def test_the_fp8_all_gather_of_a_filtered_run_is_the_compute_dtype_gather(self):
        for stage in ("3", "1"):
            with self.subTest(zero_stage=stage):
                runs = {}
                for name, extra in (("plain", []), ("gather", ["--precision.fp8_fsdp_all_gather", "true"])):
                    runs[name] = os.path.join(self.tmp, f"fsdp-zero{stage}-{name}")
                    train(runs[name], 2, "--precision.fp8", "tensorwise", "--parallelism.zero_stage", stage,
                          "--precision.fp8_filter_fqns", "attention.o,layers.1.mlp.gate_up", *extra)
                self.assertEqual(train_losses(runs["gather"]), train_losses(runs["plain"]))


if __name__ == "__main__":
    unittest.main()
