"""FLUX runs on a latent cache (flux.data_path, NOTE [FLUX latent cache]) and the validation
loss (flux.eval_data_path, NOTE [FLUX validation loss]), through the CLI on the CPU. The
caches are written here with the safetensors package from the documented layout alone, as
another tool (diffusers' script) would write them: two buckets of different latent grids,
several shards. Checked: the run trains (finite losses, every epoch's batches within one
latent size), runs are deterministic and the seed matters, a learning rate of 0 gives the same
validation loss at every evaluation, eight times are averaged, and the refusals (a cache of
another model's sizes, no whole micro-batch, eval.interval without a validation cache, a
broken cache). Caption dropout (flux.caption_dropout_prob, NOTE [FLUX caption dropout]) and
posterior latents (a "distribution" cache, NOTE [FLUX posterior latents]): dropping every
caption trains as a cache whose every caption is the empty one, a distribution cache of
negligible variance trains as the mode cache of its scaled means, runs with both are
deterministic and resume exactly, and dropout without the empty caption or without a cache is
refused."""
import json
import os
import re
import shutil
import subprocess
import unittest

import numpy as np
from safetensors.numpy import save_file

from forge_test_util import forge_bin, scratch_dir, source_dir

EXPERIMENT = os.path.join(source_dir(), "configs", "experiments", "cpu", "flux-debug.yaml")


SCALE, SHIFT = 0.3611, 0.1159


def write_cache(folder, buckets, text_tokens=8, context_dim=32, pooled_dim=16, seed=0, per_shard=3,
                empty_prompt=None, latents="mode", logvar=None, edit=None):
    """buckets: [(width, height, samples)] in pixels at the VAE's 8x; fp32 tensors. empty_prompt:
    (prompt_embeds [1, L, D], pooled [1, P]) to store; latents "distribution" stores the drawn
    values as latent_mean and `logvar` (a constant, else random in [-2, 0]) as latent_logvar;
    edit(tensors) may change a shard's tensors before they are written."""
    os.makedirs(folder)
    rng = np.random.default_rng(seed)
    logvar_rng = np.random.default_rng(seed + 1000)  # the other tensors do not depend on it
    shards, lines, total = [], [], 0
    for width, height, samples in buckets:
        for start in range(0, samples, per_shard):
            n = min(per_shard, samples - start)
            name = f"shard-{len(shards):05d}.safetensors"
            z = rng.standard_normal((n, 16, height // 8, width // 8), dtype=np.float32)
            tensors = {"prompt_embeds": rng.standard_normal((n, text_tokens, context_dim), dtype=np.float32),
                       "pooled_prompt_embeds": rng.standard_normal((n, pooled_dim), dtype=np.float32)}
            if latents == "distribution":
                tensors["latent_mean"] = z
                tensors["latent_logvar"] = (np.full_like(z, logvar) if logvar is not None else
                                            logvar_rng.uniform(-2, 0, size=z.shape).astype(np.float32))
            else:
                tensors["latents"] = z
            if edit:
                edit(tensors)
            save_file(tensors, os.path.join(folder, name))
            for r in range(n):
                lines.append(json.dumps({"shard": len(shards), "row": r, "image": f"img{total + r}.png",
                                         "caption": f"caption {total + r}"}))
            shards.append({"file": name, "samples": n, "width": width, "height": height})
            total += n
    manifest = {"format": "forge-flux-latent-cache", "version": 1, "autoencoder": "vae", "latent_channels": 16,
                "text_tokens": text_tokens, "context_dim": context_dim, "pooled_dim": pooled_dim, "dtype": "fp32",
                "samples": total, "shards": shards, "source": {"made_by": "test_flux_cache_training.py"}}
    if empty_prompt is not None:
        save_file({"prompt_embeds": empty_prompt[0], "pooled_prompt_embeds": empty_prompt[1]},
                  os.path.join(folder, "empty-prompt.safetensors"))
        manifest["empty_prompt"] = "empty-prompt.safetensors"
    if latents == "distribution":
        manifest.update({"latents": "distribution", "scaling_factor": SCALE, "shift_factor": SHIFT})
    with open(os.path.join(folder, "captions.jsonl"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(folder, "cache.json"), "w") as f:
        json.dump(manifest, f)
    return folder


def train(*overrides, run_dir=None):
    run_dir = run_dir or os.path.join(scratch_dir(), "run")
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



def final_state(run_dir, step):
    """The checkpoint's master weights and AdamW moments, as bytes."""
    with open(os.path.join(run_dir, "checkpoints", f"step-{step}", "rank-0.bin"), "rb") as f:
        return f.read()


def empty_encodings(seed=5, text_tokens=8, context_dim=32, pooled_dim=16):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((1, text_tokens, context_dim), dtype=np.float32),
            rng.standard_normal((1, pooled_dim), dtype=np.float32))


class FluxCaptionDropoutAndPosterior(unittest.TestCase):
    BUCKETS = [(64, 64, 7), (64, 32, 5)]

    @classmethod
    def setUpClass(cls):
        cls.root = scratch_dir()
        cls.empty = empty_encodings()
        cls.cache = write_cache(os.path.join(cls.root, "both"), cls.BUCKETS, empty_prompt=cls.empty,
                                latents="distribution")

    def test_dropping_every_caption_trains_on_the_empty_one(self):
        def as_empty(tensors):
            n = tensors["prompt_embeds"].shape[0]
            tensors["prompt_embeds"] = np.repeat(self.empty[0], n, axis=0)
            tensors["pooled_prompt_embeds"] = np.repeat(self.empty[1], n, axis=0)

        mode = write_cache(os.path.join(self.root, "dropped"), self.BUCKETS, empty_prompt=self.empty)
        all_empty = write_cache(os.path.join(self.root, "all-empty"), self.BUCKETS, edit=as_empty)
        # flux-debug's losses barely depend on the text at first: the final weights are compared.
        save = ("--training.steps", "4", "--checkpoint.enable", "true", "--checkpoint.interval", "100")
        code, out, dropped, _ = train("--flux.data_path", mode, "--flux.caption_dropout_prob", "1", *save,
                                      run_dir=os.path.join(self.root, "run-dropped"))
        self.assertEqual(code, 0, out)
        self.assertIn("captions dropped with probability 1", out)
        code, out, reference, _ = train("--flux.data_path", all_empty, *save,
                                        run_dir=os.path.join(self.root, "run-all-empty"))
        self.assertEqual(code, 0, out)
        self.assertEqual(dropped, reference)
        code, out, _, _ = train("--flux.data_path", mode, *save, run_dir=os.path.join(self.root, "run-kept"))
        self.assertEqual(code, 0, out)
        code, out, _, _ = train("--flux.data_path", mode, "--flux.caption_dropout_prob", "0.5", *save,
                                run_dir=os.path.join(self.root, "run-half"))
        self.assertEqual(code, 0, out)
        weights = {name: final_state(os.path.join(self.root, "run-" + name), 4)
                   for name in ("dropped", "all-empty", "kept", "half")}
        self.assertEqual(weights["dropped"], weights["all-empty"])
        self.assertNotEqual(weights["kept"], weights["dropped"])
        self.assertNotEqual(weights["half"], weights["dropped"])
        self.assertNotEqual(weights["half"], weights["kept"])

    def test_a_distribution_of_negligible_variance_trains_as_its_scaled_mean(self):
        tiny = write_cache(os.path.join(self.root, "tiny-variance"), self.BUCKETS, latents="distribution",
                           logvar=-30.0)

        def scaled(tensors):
            tensors["latents"] = ((tensors["latents"] - np.float32(SHIFT)) * np.float32(SCALE)).astype(np.float32)

        mode = write_cache(os.path.join(self.root, "scaled-mean"), self.BUCKETS, edit=scaled)
        code, out, sampled, _ = train("--flux.data_path", tiny, "--training.steps", "3")
        self.assertEqual(code, 0, out)
        self.assertIn("drawn from the posterior", out)
        code, out, reference, _ = train("--flux.data_path", mode, "--training.steps", "3")
        self.assertEqual(code, 0, out)
        for a, b in zip(sampled, reference):
            self.assertAlmostEqual(a, b, delta=2e-4)
        # A unit variance does draw: other latents, other losses.
        unit = write_cache(os.path.join(self.root, "unit-variance"), self.BUCKETS, latents="distribution",
                           logvar=0.0)
        code, out, drawn, _ = train("--flux.data_path", unit, "--training.steps", "3")
        self.assertEqual(code, 0, out)
        self.assertTrue(all(abs(a - b) > 1e-3 for a, b in zip(drawn, reference)), (drawn, reference))
        # The validation loss reads the mode: a distribution cache of any variance evaluates as
        # its scaled mean.
        args = ("--training.steps", "1", "--eval.interval", "1", "--eval.steps", "100", "--optimizer.lr", "0")
        code, out, _, noisy_eval = train("--flux.data_path", mode, "--flux.eval_data_path", self.cache, *args)
        self.assertEqual(code, 0, out)
        wide = write_cache(os.path.join(self.root, "eval-wide"), self.BUCKETS, latents="distribution", logvar=3.0,
                           empty_prompt=self.empty)
        code, out, _, wide_eval = train("--flux.data_path", mode, "--flux.eval_data_path", wide, *args)
        self.assertEqual(code, 0, out)
        self.assertEqual(noisy_eval, wide_eval)

    def test_dropout_and_sampling_are_deterministic_and_resume_exactly(self):
        args = ["--flux.data_path", self.cache, "--flux.caption_dropout_prob", "0.5", "--checkpoint.enable", "true",
                "--checkpoint.interval", "2"]
        full_dir = os.path.join(self.root, "full")
        code, out, full, _ = train(*args, "--training.steps", "6", run_dir=full_dir)
        self.assertEqual(code, 0, out)
        self.assertEqual(len(full), 6, out)
        code, out, again, _ = train(*args, "--training.steps", "6")
        self.assertEqual(again, full)
        code, out, other, _ = train(*args, "--training.steps", "6", "--training.seed", "9")
        self.assertNotEqual(other, full)
        resumed_dir = os.path.join(self.root, "resumed")
        code, out, first, _ = train(*args, "--training.steps", "3", run_dir=resumed_dir)
        self.assertEqual(code, 0, out)
        code, out, second, _ = train(*args, "--training.steps", "6", run_dir=resumed_dir)
        self.assertEqual(code, 0, out)
        self.assertIn("resuming from checkpoint", out)
        self.assertEqual(first + second, full)
        self.assertEqual(final_state(resumed_dir, 6), final_state(full_dir, 6))

    def test_refusals(self):
        plain = write_cache(os.path.join(self.root, "no-empty"), [(64, 64, 4)])
        code, out, _, _ = train("--flux.data_path", plain, "--flux.caption_dropout_prob", "0.1", "--training.steps",
                                "1")
        self.assertNotEqual(code, 0)
        self.assertIn("flux.caption_dropout_prob", out)
        self.assertIn(plain, out)
        self.assertIn("empty caption", out)
        code, out, _, _ = train("--flux.caption_dropout_prob", "0.1", "--training.steps", "1")
        self.assertNotEqual(code, 0)
        self.assertIn("flux.data_path", out)
        code, out, _, _ = train("--flux.caption_dropout_prob", "2", "--training.steps", "1")
        self.assertNotEqual(code, 0)
        self.assertIn("flux.caption_dropout_prob", out)
        shutil.rmtree(plain)


if __name__ == "__main__":
    unittest.main()
