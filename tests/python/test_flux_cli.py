"""FLUX runs through the CLI on the CPU reference: forge train on the flux-debug experiment
(the loss is finite and logged per step), forge bench on it (images/s in bench.json, a
perf.csv row), forge info flux1-dev (the published parameter count, FLOPs and memory), and
the refusals: flux.* keys without flux.model, an image size the patches do not divide, the
language models' features a FLUX run lacks, an unknown key to forge info."""
import csv
import json
import os
import re
import subprocess
import unittest

from forge_test_util import forge_bin, scratch_dir, source_dir


def forge(*args):
    return subprocess.run([forge_bin(), *args], capture_output=True, text=True, timeout=600)


def experiment():
    return os.path.join(source_dir(), "configs", "experiments", "cpu", "flux-debug.yaml")


class FluxCli(unittest.TestCase):
    def test_train_logs_every_step(self):
        run_dir = os.path.join(scratch_dir(), "run")
        result = forge("train", experiment(), "--training.steps", "4", "--logging.run_dir", run_dir)
        self.assertEqual(result.returncode, 0, result.stderr)
        losses = [float(m) for m in re.findall(r"step +\d+ \| loss ([0-9.]+)", result.stderr + result.stdout)]
        self.assertEqual(len(losses), 4, result.stderr)
        self.assertTrue(all(0 < loss < 10 for loss in losses), losses)

    def test_bench_reports_images_per_second(self):
        tmp = scratch_dir()
        out, perf = os.path.join(tmp, "bench"), os.path.join(tmp, "perf.csv")
        result = forge("bench", experiment(), "--warmup", "1", "--steps", "2", "--output-dir", out, "--perf-csv", perf)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("images/s/GPU", result.stderr + result.stdout)
        with open(os.path.join(out, "bench.json")) as f:
            (r,) = json.load(f)
        self.assertEqual(r["status"], "ok", r["error"])
        self.assertEqual(r["model"], "flux-debug")
        self.assertGreater(r["images_per_s_per_gpu"], 0)
        self.assertGreater(r["tflops_per_gpu"], 0)
        self.assertEqual(r["seq_len"], 16 + 8)  # a 4x4 latent grid of 64-pixel images, 8 text tokens
        with open(perf) as f:
            self.assertEqual(len(list(csv.DictReader(f))), 1)

    def test_info_flux1_dev(self):
        result = forge("info", "flux1-dev")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("11901408320", result.stdout)
        self.assertIn("4096 image tokens", result.stdout)
        self.assertIn("FLOPs per image", result.stdout)
        self.assertIn("activation_checkpoint.mode full", result.stdout)
        result = forge("info", "flux1-schnell", "--flux.resolution", "512", "--activation_checkpoint.mode", "none")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("1024 image tokens", result.stdout)
        result = forge("info", "flux1-dev", "--training.seq_len", "4")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("--training.seq_len", result.stderr)

    def test_start_from_diffusers_weights_and_export_them(self):
        import torch
        from diffusers import FluxTransformer2DModel
        tmp = scratch_dir()
        torch.manual_seed(0)
        # flux-debug's architecture in diffusers.
        model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2,
                                       attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                       pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
        source = os.path.join(tmp, "source")
        model.save_pretrained(source)
        run_dir = os.path.join(tmp, "run")
        # lr 0: the exported weights are the loaded ones, bit for bit (fp32 export).
        result = forge("train", experiment(), "--training.steps", "1", "--optimizer.lr", "0", "--logging.run_dir",
                       run_dir, "--flux.initial_load_path", source, "--flux.last_save_in_diffusers", "true",
                       "--checkpoint.export_dtype", "fp32")
        self.assertEqual(result.returncode, 0, result.stderr)
        back = FluxTransformer2DModel.from_pretrained(os.path.join(run_dir, "diffusers"))
        for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
            self.assertTrue(torch.equal(a, b), name)
        # Weights of another architecture.
        result = forge("train", experiment(), "--training.steps", "1", "--flux.initial_load_path", source,
                       "--flux.num_single_blocks", "3")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn('"num_single_layers" is 2', result.stderr)
        result = forge("train", experiment(), "--flux.initial_load_path", os.path.join(tmp, "nothing"))
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("not found", result.stderr)

    def test_bad_flux_settings_are_refused(self):
        cases = [
            (["--flux.model", "", "--flux.resolution", "512"], "flux.model is empty"),
            (["--flux.resolution", "72"], "multiple of 16"),
            (["--flux.model", "flux3"], "unknown FLUX model"),
            (["--lora.rank", "8"], "lora.rank"),
            (["--activation_checkpoint.mode", "selective"], "none or full"),
            (["--eval.interval", "5"], "eval.interval 0"),
        ]
        for overrides, fragment in cases:
            with self.subTest(overrides):
                result = forge("train", experiment(), "--training.steps", "1", *overrides)
                self.assertNotEqual(result.returncode, 0)
                self.assertIn(fragment, result.stderr)


if __name__ == "__main__":
    unittest.main()
