"""FLUX runs on a latent cache (flux.data_path, NOTE [FLUX latent cache]) and the validation
loss (flux.eval_data_path, NOTE [FLUX validation loss]), through the CLI on the CPU. The
caches are written here with the safetensors package from the documented layout alone, as
another tool (diffusers' script) would write them: two buckets of different latent grids,
several shards. Checked: the run trains (finite losses, every epoch's batches within one
latent size), runs are deterministic and the seed matters, a learning rate of 0 gives the same
validation loss at every evaluation, eight times are averaged, and the refusals (a cache of
another model's sizes, no whole micro-batch, eval.interval without a validation cache, a
broken cache)."""
import json
import os
import re
import subprocess
import unittest

import numpy as np
from safetensors.numpy import save_file

from forge_test_util import forge_bin, scratch_dir, source_dir

EXPERIMENT = os.path.join(source_dir(), "configs", "experiments", "cpu", "flux-debug.yaml")


def write_cache(folder, buckets, text_tokens=8, context_dim=32, pooled_dim=16, seed=0, per_shard=3):
    """buckets: [(width, height, samples)] in pixels at the VAE's 8x; fp32 tensors."""
    os.makedirs(folder)
    rng = np.random.default_rng(seed)
    shards, lines, total = [], [], 0
    for width, height, samples in buckets:
        for start in range(0, samples, per_shard):
            n = min(per_shard, samples - start)
            name = f"shard-{len(shards):05d}.safetensors"
            save_file({"latents": rng.standard_normal((n, 16, height // 8, width // 8), dtype=np.float32),
                       "prompt_embeds": rng.standard_normal((n, text_tokens, context_dim), dtype=np.float32),
                       "pooled_prompt_embeds": rng.standard_normal((n, pooled_dim), dtype=np.float32)},
                      os.path.join(folder, name))
            for r in range(n):
                lines.append(json.dumps({"shard": len(shards), "row": r, "image": f"img{total + r}.png",
                                         "caption": f"caption {total + r}"}))
            shards.append({"file": name, "samples": n, "width": width, "height": height})
            total += n
    manifest = {"format": "forge-flux-latent-cache", "version": 1, "autoencoder": "vae", "latent_channels": 16,
                "text_tokens": text_tokens, "context_dim": context_dim, "pooled_dim": pooled_dim, "dtype": "fp32",
                "samples": total, "shards": shards, "source": {"made_by": "test_flux_cache_training.py"}}
    with open(os.path.join(folder, "captions.jsonl"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(folder, "cache.json"), "w") as f:
        json.dump(manifest, f)
    return folder


def train(*overrides):
    run_dir = os.path.join(scratch_dir(), "run")
    result = subprocess.run([forge_bin(), "train", EXPERIMENT, "--logging.run_dir", run_dir, *overrides],
                            capture_output=True, text=True, timeout=600)
    out = result.stdout + result.stderr
    losses = [float(m) for m in re.findall(r"step +\d+ \| loss ([0-9.]+)", out)]
    evals = [(float(m.group(1)), [float(v) for v in m.group(2).split()])
             for m in re.finditer(r"validation loss ([0-9.]+) over \d+ samples \| at t = [^:]*: ([-0-9. na]+)", out)]
    return result.returncode, out, losses, evals


class FluxCacheTraining(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        root = scratch_dir()
        # 64x64 (8x8 latents, 16 tokens) and 32x64 (4x8 latents, 8 tokens) in shards of 3.
        cls.train_cache = write_cache(os.path.join(root, "train"), [(64, 64, 7), (64, 32, 5)])
        cls.eval_cache = write_cache(os.path.join(root, "eval"), [(64, 64, 9), (32, 32, 4)], seed=1)

    def test_trains_on_a_cache_deterministically(self):
        args = ["--flux.data_path", self.train_cache, "--training.steps", "6"]
        code, out, losses, _ = train(*args)
        self.assertEqual(code, 0, out)
        self.assertIn("FLUX data:", out)
        self.assertIn("12 samples in 5 shards", out)
        self.assertEqual(len(losses), 6, out)
        self.assertTrue(all(0 < v < 10 for v in losses), losses)
        code, out, again, _ = train(*args)
        self.assertEqual(again, losses)
        code, out, other, _ = train(*args, "--training.seed", "7")
        self.assertEqual(code, 0, out)
        self.assertNotEqual(other, losses)

    def test_validation_loss_is_fixed_for_fixed_weights(self):
        code, out, _, evals = train("--flux.data_path", self.train_cache, "--flux.eval_data_path", self.eval_cache,
                                    "--training.steps", "4", "--eval.interval", "2", "--eval.steps", "100",
                                    "--optimizer.lr", "0", "--lr_scheduler.warmup_steps", "0")
        self.assertEqual(code, 0, out)
        self.assertEqual(len(evals), 2, out)
        self.assertIn("over 13 samples", out)
        (first, per_time), (second, _) = evals
        self.assertEqual(first, second)
        self.assertEqual(len(per_time), 8)
        self.assertAlmostEqual(first, sum(per_time) / 8, places=3)
        # The loss near data (t = 0: the velocity noise - x0 from x0) differs from the one near noise.
        self.assertNotAlmostEqual(per_time[0], per_time[7], places=3)
        # eval.steps bounds the samples: 1 micro-batch of 2.
        code, out, _, evals = train("--flux.data_path", self.train_cache, "--flux.eval_data_path", self.eval_cache,
                                    "--training.steps", "1", "--eval.interval", "1", "--eval.steps", "1")
        self.assertEqual(code, 0, out)
        self.assertIn("over 2 samples", out)
        self.assertTrue(all(v != v for v in evals[0][1][2:]), evals)  # NaN: no sample at those times

    def test_refusals(self):
        root = scratch_dir()
        wide = write_cache(os.path.join(root, "wide"), [(64, 64, 4)], context_dim=48)
        code, out, _, _ = train("--flux.data_path", wide, "--training.steps", "1")
        self.assertNotEqual(code, 0)
        self.assertIn("text features of 48", out)
        code, out, _, _ = train("--flux.data_path", self.train_cache, "--training.local_batch_size", "8",
                                "--training.steps", "1")
        self.assertNotEqual(code, 0)
        self.assertIn("no latent size has a whole micro-batch of 8 samples", out)
        code, out, _, _ = train("--eval.interval", "2", "--training.steps", "1")
        self.assertNotEqual(code, 0)
        self.assertIn("flux.eval_data_path", out)
        code, out, _, _ = train("--flux.data_path", os.path.join(root, "missing"), "--training.steps", "1")
        self.assertNotEqual(code, 0)
        self.assertIn("missing", out)
        broken = write_cache(os.path.join(root, "broken"), [(64, 64, 4)])
        with open(os.path.join(broken, "shard-00001.safetensors"), "r+b") as f:
            f.truncate(100)
        code, out, _, _ = train("--flux.data_path", broken, "--training.steps", "1")
        self.assertNotEqual(code, 0)
        self.assertIn("shard-00001.safetensors", out)


if __name__ == "__main__":
    unittest.main()
