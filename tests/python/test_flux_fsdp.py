"""FLUX under FSDP across real processes on the CPU (forge launch, the CPU process group;
NOTE [FLUX FSDP], NOTE [FLUX FSDP checkpoints]): flux-debug on a small latent cache of two
latent sizes, the same global batch on 1 rank (accumulation 4), 2 ranks (ZeRO-1, -2, -3,
bf16 reduction) and 4 ranks (2 shard ranks x 2 replicas): the losses of every step and the
validation losses within fp32 rounding of the 1-rank run, and the master weights and AdamW
moments after the last step too (read from the checkpoints both runs save), and the diffusers
export, which every rank writes its chunks of (NOTE [FLUX export in pieces]); so does a run
starting from a checkpoint's weights, and runs starting from the diffusers export with lr 0
on 2 ranks (ZeRO-3, ZeRO-2) and 4 (2 x 2 replicas) re-export it byte for byte. A run stopped and
resumed under FSDP ends with the uninterrupted run's checkpoint byte for byte, asynchronous
saves and a small buffer change no byte; a checkpoint
saved on 2 ranks resumes on 1 and on 4. forge info counts what each rank holds. The refusals: another parallelism, degrees that do
not match the ranks started, a multi-rank degree in a single process."""
import json
import os
import re
import shutil
import subprocess
import unittest

import numpy as np

from forge_test_util import forge_bin, scratch_dir, source_dir
from test_flux_cache_training import write_cache

EXPERIMENT = os.path.join(source_dir(), "configs", "experiments", "cpu", "flux-debug.yaml")
TIMEOUT = 300
STEPS = 6
GLOBAL_MICRO_BATCHES = 4  # of 2 samples: accumulation 4 on 1 rank, 2 on 2 ranks, 1 on 4 ranks
ENV = dict(os.environ, FORGE_NUM_THREADS="1")


def train(run_dir, ranks, *overrides, shard=None, replicate=1, steps=STEPS, data=None, check=True):
    """flux-debug on `ranks` CPU ranks, micro-batch 2, the accumulation filling the global
    batch; a checkpoint at steps 2, 4, 6."""
    accumulation = GLOBAL_MICRO_BATCHES // ranks
    args = ["train", EXPERIMENT, "--training.steps", str(steps), "--training.gradient_accumulation_steps",
            str(accumulation), "--logging.run_dir", run_dir, "--checkpoint.enable", "true",
            "--checkpoint.interval", "2", "--parallelism.data_parallel_shard_degree", str(shard or ranks // replicate),
            "--parallelism.data_parallel_replicate_degree", str(replicate), *(data or []), *overrides]
    command = [forge_bin(), "launch", "--nproc-per-node", str(ranks), "--", *args] if ranks > 1 else [forge_bin(), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=ENV)
    out = result.stdout + result.stderr
    if check and result.returncode != 0:
        raise AssertionError(f"{command} exited {result.returncode}\n{out[-4000:]}")
    return result.returncode, out


def losses(out):
    return {int(s): float(v) for s, v in re.findall(r"step +(\d+) \| loss ([0-9.]+)", out)}


def validation_losses(out):
    return [float(v) for v in re.findall(r"validation loss ([0-9.]+) over", out)]


def state(run_dir, step=STEPS):
    """{(state, name): fp32 values} of a checkpoint."""
    folder = os.path.join(run_dir, "checkpoints", f"step-{step}")
    with open(os.path.join(folder, "metadata.json")) as f:
        tensors = json.load(f)["tensors"]
    with open(os.path.join(folder, "rank-0.bin"), "rb") as f:
        data = f.read()
    values = {}
    for t in tensors:
        parts = [np.frombuffer(data, np.float32, p["byte_length"] // 4, p["byte_offset"]) for p in t["pieces"]]
        values[(t["state"], t["name"])] = np.concatenate(parts)
    return values


def directory_bytes(folder):
    """{name: bytes} of every file in a folder."""
    files = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            files[name] = f.read()
    return files


def checkpoint_bytes(run_dir, step=STEPS):
    with open(os.path.join(run_dir, "checkpoints", f"step-{step}", "rank-0.bin"), "rb") as f:
        return f.read()


class FluxFsdp(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = scratch_dir()
        cache_root = os.path.join(cls.root, "caches")
        # 64x64 (16 tokens) and 64x32 (8 tokens) latents; 8 validation micro-batches of 2 at most.
        train_cache = write_cache(os.path.join(cache_root, "train"), [(64, 64, 9), (64, 32, 7)])
        eval_cache = write_cache(os.path.join(cache_root, "eval"), [(64, 64, 9), (32, 32, 6)], seed=1)
        cls.data = ["--flux.data_path", train_cache, "--flux.eval_data_path", eval_cache, "--eval.interval", "3",
                    "--eval.steps", "4"]
        cls.single_dir = cls.run_dir("single")
        _, cls.single_out = train(cls.single_dir, 1, data=cls.data)
        cls.single = losses(cls.single_out)
        cls.single_state = state(cls.single_dir)

    @classmethod
    def run_dir(cls, name):
        path = os.path.join(cls.root, name)
        shutil.rmtree(path, ignore_errors=True)
        return path

    def assert_follows_one_rank(self, out, run_dir, tolerance=2e-5, weight_tolerance=1e-5):
        curve = losses(out)
        self.assertEqual(sorted(curve), list(range(1, STEPS + 1)), out[-3000:])
        for step, loss in self.single.items():
            self.assertLess(abs(curve[step] - loss), tolerance * max(1.0, loss), (step, curve[step], loss))
        single_eval, eval_losses = validation_losses(self.single_out), validation_losses(out)
        self.assertEqual(len(single_eval), 2, self.single_out[-3000:])
        self.assertEqual(len(eval_losses), 2, out[-3000:])
        for a, b in zip(eval_losses, single_eval):
            self.assertLess(abs(a - b), tolerance * max(1.0, b), (a, b))
        values = state(run_dir)
        self.assertEqual(values.keys(), self.single_state.keys())
        for key, expected in self.single_state.items():
            scale = max(1.0, float(np.abs(expected).max()))
            difference = float(np.abs(values[key] - expected).max())
            self.assertLess(difference, weight_tolerance * scale, key)

    def test_two_ranks_follow_one_in_every_zero_stage(self):
        for stage in (3, 2, 1):
            with self.subTest(zero_stage=stage):
                run_dir = self.run_dir(f"zero{stage}")
                _, out = train(run_dir, 2, "--parallelism.zero_stage", str(stage), data=self.data)
                self.assertIn(f"fsdp rank 1 of 2 (ZeRO-{stage}, 2 shard ranks x 1 replicas)", out)
                self.assertIn("1/2 of the model's", out)
                self.assertIn("images/s/GPU", out)
                self.assertIn("each of the 2 data-parallel ranks reads 2 of the step's 4", out)
                self.assertNotIn("[rank 1] step", out)  # rank 0 alone prints the step lines
                self.assert_follows_one_rank(out, run_dir)

    def test_hybrid_sharding_and_bf16_reduction(self):
        run_dir = self.run_dir("hybrid")
        _, out = train(run_dir, 4, replicate=2, data=self.data)
        self.assertIn("fsdp rank 3 of 4 (ZeRO-3, 2 shard ranks x 2 replicas)", out)
        self.assert_follows_one_rank(out, run_dir)
        run_dir = self.run_dir("bf16")
        _, out = train(run_dir, 2, "--precision.reduce_dtype", "bf16", data=self.data)
        self.assert_follows_one_rank(out, run_dir, tolerance=5e-3, weight_tolerance=5e-3)

    def test_validation_loss_split_or_not(self):
        """eval.steps 3: 3 validation micro-batches do not split over 2 ranks, so each rank
        evaluates all of them (the ZeRO-3 gathers are collectives); the loss is the same."""
        data = self.data[:-1] + ["3"]
        _, one = train(self.run_dir("eval-one"), 1, steps=3, data=data)
        _, two = train(self.run_dir("eval-two"), 2, steps=3, data=data)
        a, b = validation_losses(one), validation_losses(two)
        self.assertEqual(len(a), 1, one[-3000:])
        self.assertEqual(len(b), 1, two[-3000:])
        self.assertLess(abs(a[0] - b[0]), 2e-5 * max(1.0, a[0]))

    def test_resume_under_fsdp_is_bitwise(self):
        whole = self.run_dir("resume-whole")
        train(whole, 2, data=self.data)
        stopped = self.run_dir("resume-stopped")
        _, first = train(stopped, 2, steps=4, data=self.data)
        self.assertEqual(sorted(losses(first)), [1, 2, 3, 4])
        _, second = train(stopped, 2, data=self.data)
        self.assertIn("resuming from checkpoint", second)
        self.assertIn("each of 2 ranks read its own segments", second)
        self.assertEqual(sorted(losses(second)), [5, 6])
        self.assertEqual(checkpoint_bytes(stopped), checkpoint_bytes(whole))
        self.assertEqual(checkpoint_bytes(stopped, 4), checkpoint_bytes(whole, 4))

    def test_async_saves_and_a_small_buffer_change_no_byte(self):
        sync = self.run_dir("saves-sync")
        train(sync, 2, data=self.data)
        for extra in (["--checkpoint.async_mode", "async"], ["--checkpoint.buffer_mb", "1"]):
            with self.subTest(extra=extra):
                run_dir = self.run_dir("saves-" + extra[-1])
                _, out = train(run_dir, 2, *extra, data=self.data)
                if "async" in extra:
                    self.assertIn("asynchronous: the step loop waited", out)
                for step in (2, 4, 6):
                    self.assertEqual(checkpoint_bytes(run_dir, step), checkpoint_bytes(sync, step))

    def test_checkpoint_saved_on_two_ranks_resumes_on_one_and_four(self):
        saved = self.run_dir("saved-on-two")
        train(saved, 2, steps=4, data=self.data)
        for ranks in (1, 4):
            with self.subTest(ranks=ranks):
                run_dir = self.run_dir(f"resumed-on-{ranks}")
                shutil.copytree(os.path.join(saved, "checkpoints"), os.path.join(run_dir, "checkpoints"))
                _, out = train(run_dir, ranks, data=self.data)
                self.assertIn("resuming from checkpoint", out)
                curve = losses(out)
                self.assertEqual(sorted(curve), [5, 6], out[-3000:])
                for step in (5, 6):
                    self.assertLess(abs(curve[step] - self.single[step]), 2e-5 * max(1.0, self.single[step]))
        # A 1-rank checkpoint resumes on 2 ranks too.
        run_dir = self.run_dir("from-single")
        shutil.copytree(os.path.join(self.single_dir, "checkpoints"), os.path.join(run_dir, "checkpoints"))
        shutil.rmtree(os.path.join(run_dir, "checkpoints", "step-6"))
        _, out = train(run_dir, 2, data=self.data)
        self.assertEqual(sorted(losses(out)), [5, 6], out[-3000:])

    def test_initial_load_path_under_fsdp(self):
        start = os.path.join(self.single_dir, "checkpoints", "step-4")
        curves = {}
        for ranks in (1, 2):
            _, out = train(self.run_dir(f"initial-{ranks}"), ranks, "--checkpoint.initial_load_path", start, steps=2,
                           data=self.data)
            self.assertIn("initial FLUX weights from checkpoint", out)
            curves[ranks] = losses(out)
        self.assertEqual(sorted(curves[2]), [1, 2])
        for step in (1, 2):
            self.assertLess(abs(curves[2][step] - curves[1][step]), 2e-5 * max(1.0, curves[1][step]))
        self.assertNotEqual(curves[1][1], self.single[1])  # it started from the checkpoint's weights

    def test_diffusers_export_written_in_pieces_is_the_one_rank_export(self):
        from safetensors.numpy import load_file
        export = ["--flux.last_save_in_diffusers", "true", "--checkpoint.export_dtype", "fp32"]
        exported = {}
        for ranks in (1, 2):
            run_dir = self.run_dir(f"export-{ranks}")
            _, out = train(run_dir, ranks, *export, steps=2, data=self.data)
            self.assertIn("exported the FLUX weights", out)
            if ranks > 1:  # NOTE [FLUX export in pieces]: no rank gathers the model
                self.assertIn("written by every rank, each its own chunks: nothing gathered", out)
            exported[ranks] = load_file(os.path.join(run_dir, "diffusers", "diffusion_pytorch_model.safetensors"))
        self.assertEqual(exported[1].keys(), exported[2].keys())
        for name, values in exported[1].items():
            self.assertLess(float(np.abs(exported[2][name] - values).max()), 1e-5 * max(1.0, float(np.abs(values).max())),
                            name)
        # Starting from the 1-rank export (flux.initial_load_path, read a tensor at a time,
        # each rank keeping its segments) with lr 0, 2 ranks under ZeRO-3 and ZeRO-2 and 4
        # ranks of 2 shard ranks x 2 replicas write, each its own chunks, the same files
        # byte for byte; so do 1 and 2 ranks in bf16.
        source = os.path.join(self.root, "export-1", "diffusers")
        source_files = directory_bytes(source)
        self.assertEqual(sorted(source_files), ["config.json", "diffusion_pytorch_model.safetensors"])
        again = ["--flux.initial_load_path", source, "--optimizer.lr", "0", "--checkpoint.enable", "false"]
        bf16 = {}
        for ranks, replicate, stage, dtype in ((2, 1, 3, "fp32"), (2, 1, 2, "fp32"), (4, 2, 3, "fp32"),
                                               (1, 1, 3, "bf16"), (2, 1, 3, "bf16")):
            with self.subTest(ranks=ranks, replicate=replicate, zero_stage=stage, dtype=dtype):
                run_dir = self.run_dir(f"from-diffusers-{ranks}-{replicate}-{stage}-{dtype}")
                _, out = train(run_dir, ranks, *export, *again, "--parallelism.zero_stage", str(stage),
                               "--checkpoint.export_dtype", dtype, replicate=replicate, steps=1, data=self.data)
                if ranks > 1:
                    self.assertIn("each rank kept its segments", out)
                    self.assertIn("nothing gathered", out)
                files = directory_bytes(os.path.join(run_dir, "diffusers"))
                self.assertFalse([name for name in os.listdir(run_dir) if ".tmp-export-" in name])
                if dtype == "fp32":
                    self.assertEqual(files, source_files)
                else:
                    bf16[ranks] = files
        self.assertEqual(bf16[2], bf16[1])
        # checkpoint.export_max_shard_size cuts the files written in pieces as diffusers
        # would: several files and an index, holding the source's tensors exactly.
        run_dir = self.run_dir("from-diffusers-sharded")
        train(run_dir, 2, *export, *again, "--checkpoint.export_max_shard_size", "100KB", steps=1, data=self.data)
        sharded = os.path.join(run_dir, "diffusers")
        with open(os.path.join(sharded, "diffusion_pytorch_model.safetensors.index.json")) as f:
            weight_map = json.load(f)["weight_map"]
        self.assertGreater(len(set(weight_map.values())), 2)
        tensors = {}
        for name in sorted(set(weight_map.values())):
            tensors.update(load_file(os.path.join(sharded, name)))
        source_tensors = load_file(os.path.join(source, "diffusion_pytorch_model.safetensors"))
        self.assertEqual(sorted(tensors), sorted(source_tensors))
        for name, values in source_tensors.items():
            self.assertTrue(np.array_equal(tensors[name], values), name)

    def test_info_counts_what_each_rank_holds(self):
        result = subprocess.run([forge_bin(), "info", "flux1-dev", "--parallelism.data_parallel_shard_degree", "8"],
                                capture_output=True, text=True, timeout=TIMEOUT, env=ENV)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("per rank         FSDP ZeRO-3 over 8 shard ranks", result.stdout)
        # 11.9 B parameters x 16 bytes of fp32 master, gradient and moments over 8 ranks.
        master = float(re.search(r"master +([0-9.]+) GiB  fp32 chunk", result.stdout).group(1))
        self.assertAlmostEqual(master, 11901408320 * 4 / 8 / 2**30, delta=0.05)
        result = subprocess.run([forge_bin(), "info", "flux1-dev", "--parallelism.zero_stage", "4",
                                 "--parallelism.data_parallel_shard_degree", "2"],
                                capture_output=True, text=True, timeout=TIMEOUT, env=ENV)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("--parallelism.zero_stage 4", result.stderr)

    def test_refusals(self):
        cases = [
            (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
             "parallelism.tensor_parallel_degree"),
            (2, ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
             "parallelism.context_parallel_degree"),
            (1, ["--parallelism.data_parallel_shard_degree", "2"], "was started alone"),
            (2, ["--parallelism.data_parallel_shard_degree", "3"], "2 ranks were started"),
            (2, ["--parallelism.data_parallel_shard_degree", "-1", "--parallelism.data_parallel_replicate_degree",
                 "3"], "parallelism.data_parallel_shard_degree"),
            (2, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.zero_stage", "4"],
             "parallelism.zero_stage"),
            # NOTE [bf16 master weights]: bf16 moments and weights are one device's economies.
            (1, ["--optimizer.state_dtype", "bf16", "--training.device", "cuda", "--precision.compute_dtype", "bf16",
                 "--parallelism.data_parallel_shard_degree", "2"], "under FSDP keeps fp32"),
            (1, ["--optimizer.master_dtype", "bf16", "--parallelism.data_parallel_shard_degree", "2"],
             "under FSDP keeps fp32"),
        ]
        for ranks, overrides, message in cases:
            with self.subTest(overrides=overrides):
                args = ["train", EXPERIMENT, "--training.steps", "1", "--logging.run_dir", self.run_dir("refused"),
                        *overrides]
                command = ([forge_bin(), "launch", "--nproc-per-node", str(ranks), "--", *args] if ranks > 1
                           else [forge_bin(), *args])
                result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=ENV)
                self.assertNotEqual(result.returncode, 0)
                self.assertIn(message, result.stdout + result.stderr)


if __name__ == "__main__":
    unittest.main()
