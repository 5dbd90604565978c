"""forge's command line end to end: the default run learns the built-in synthetic corpus
down to near its entropy floor, runs are deterministic, and bad input of every kind is a
clear error with a non-zero exit."""
import os
import re
import subprocess
import unittest

from forge_test_util import forge_bin, records, scratch_dir, source_dir

# The default run (forge train, no arguments) must end with a validation loss within this
# many nats/token of the synthetic corpus's entropy floor.
FLOOR_MARGIN = 0.15


def forge(*args, cwd=None):
    return subprocess.run([forge_bin(), *args], capture_output=True, text=True, cwd=cwd)



class DefaultRun(unittest.TestCase):
    def test_default_run_reaches_the_entropy_floor(self):
        run_dir = os.path.join(scratch_dir(), "run")
        result = forge("train", "--logging.run_dir", run_dir)
        self.assertEqual(result.returncode, 0, result.stderr)
        floor = records(run_dir, "run")[0]["entropy_floor"]
        evals = records(run_dir, "eval")
        train = records(run_dir, "train")
        print(f"entropy floor {floor:.4f}, first loss {train[0]['loss']:.4f}, "
              f"final eval loss {evals[-1]['loss']:.4f}, gap {evals[-1]['loss'] - floor:.4f}")
        self.assertGreater(floor, 0)
        self.assertLess(evals[-1]["loss"] - floor, FLOOR_MARGIN)
        self.assertGreater(evals[-1]["loss"], floor - 0.02, "validation loss below the entropy floor")
        self.assertTrue(os.path.isfile(os.path.join(run_dir, "config.yaml")))
        for r in train:
            for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "model_tflops", "mfu"):
                self.assertIn(key, r)


class Determinism(unittest.TestCase):
    def test_same_seed_same_losses(self):
        runs = []
        for _ in range(2):
            run_dir = os.path.join(scratch_dir(), "run")
            result = forge("train", "--training.steps", "6", "--eval.interval", "3", "--logging.run_dir", run_dir)
            self.assertEqual(result.returncode, 0, result.stderr)
            runs.append([r["loss"] for r in records(run_dir, "train") + records(run_dir, "eval")])
        self.assertEqual(runs[0], runs[1])

    def test_other_seed_other_losses(self):
        losses = []
        for seed in ("1", "2"):
            run_dir = os.path.join(scratch_dir(), "run")
            result = forge("train", "--training.steps", "2", "--training.seed", seed, "--logging.run_dir", run_dir)
            self.assertEqual(result.returncode, 0, result.stderr)
            losses.append([r["loss"] for r in records(run_dir, "train")])
        self.assertNotEqual(losses[0], losses[1])


class Profiling(unittest.TestCase):
    def test_profile_ops_reports_time_per_op_class(self):
        run_dir = os.path.join(scratch_dir(), "run")
        result = forge("train", "--training.steps", "2", "--logging.profile_ops", "true", "--logging.run_dir", run_dir)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("time by op class", result.stdout)
        for r in records(run_dir, "train"):
            self.assertEqual(set(r["op_seconds"]), {"gemm", "attention", "elementwise", "optimizer"})
            self.assertLessEqual(sum(r["op_seconds"].values()), r["step_time_s"])
            self.assertIn("matmul", r["op_seconds_by_op"])


class Commands(unittest.TestCase):
    def test_version_and_help(self):
        self.assertIn("forge", forge("--version").stdout)
        help_text = forge("--help").stdout
        for sub in ("train", "info", "keys"):
            self.assertIn(sub, help_text)

    def test_info_llama31_8b(self):
        result = forge("info", "llama3.1-8b")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("8.03 B", result.stdout)

    def test_info_fp8(self):
        # Llama 3.1 8B at seq 8192: the block projections' weights are 32 x (4096 x 6144 +
        # 4096 x 4096 + 3 x 4096 x 14336); their GEMMs' share of 6 x (params - embedding) +
        # 6 x layers x hidden x seq. The GPU memory line counts the FP8 scratch (0.44 GiB).
        result = forge("info", "llama3.1-8b", "--precision.fp8", "tensorwise", "--training.seq_len", "8192",
                       "--training.local_batch_size", "1")
        self.assertEqual(result.returncode, 0, result.stderr)
        fp8 = [line for line in result.stdout.splitlines() if line.startswith("FP8 ")]
        self.assertEqual(len(fp8), 1, result.stdout)
        projections = 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)
        params = 8030261248
        share = 6 * projections / (6 * (params - 128256 * 4096) + 6 * 32 * 4096 * 8192)
        self.assertIn(f"tensorwise: the forward, input- and weight-gradient GEMMs of qkv, o, gate/up and down in "
                      f"FP8 ({100 * share:.1f}% of the FLOPs per token)", fp8[0])
        self.assertIn("gradients e5m2; the output head in bf16", fp8[0])
        gpu = [line for line in result.stdout.splitlines() if "one GPU" in line]
        self.assertIn("FP8 GEMM scratch 0.66 GiB + FP8 weight cache 13.00 GiB", gpu[0])  # 2 x the projections
        self.assertIn("weights cast in every micro-batch", fp8[0])  # the CPU has no weight cache
        on_gpu = forge("info", "llama3.1-8b", "--precision.fp8", "tensorwise", "--training.device", "cuda")
        self.assertIn("weights cast once per optimizer step (precision.fp8_weight_cache)", on_gpu.stdout)
        uncached = forge("info", "llama3.1-8b", "--precision.fp8", "delayed", "--precision.fp8_weight_cache", "false")
        self.assertIn("FP8              delayed (amax history 1024, max, margin 0): ", uncached.stdout)
        self.assertNotIn("weight cache", uncached.stdout)
        cpu = [line for line in result.stdout.splitlines() if "CPU (fp32)" in line]
        self.assertNotIn("FP8", cpu[0])

    def test_info_fp8_under_lora(self):
        # NOTE [FP8 frozen base]: the frozen projections' forward and input-gradient GEMMs, 4
        # FLOPs per weight of NOTE [LoRA FLOPs]'s count; two code buffers of scratch (no dW).
        result = forge("info", "llama3.1-8b", "--precision.fp8", "tensorwise", "--training.seq_len", "8192",
                       "--training.local_batch_size", "1", "--training.device", "cuda", "--lora.rank", "16")
        self.assertEqual(result.returncode, 0, result.stderr)
        fp8 = [line for line in result.stdout.splitlines() if line.startswith("FP8 ")]
        flops = [line for line in result.stdout.splitlines() if line.startswith("LoRA FLOPs/token")]
        projections = 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)
        share = 4 * projections / float(flops[0].split()[2])
        self.assertIn(f"tensorwise: the forward and input-gradient GEMMs of the frozen qkv, o, gate/up and down in "
                      f"FP8 ({100 * share:.1f}% of the FLOPs per token)", fp8[0])
        self.assertIn("the output head in bf16, LoRA adapters, embedding", fp8[0])
        self.assertIn("weights cast once for the run (precision.fp8_weight_cache: the base is frozen)", fp8[0])
        gpu = [line for line in result.stdout.splitlines() if "one GPU" in line]
        self.assertIn("frozen bf16 weights", gpu[0])
        self.assertIn("FP8 GEMM scratch 0.44 GiB + FP8 weight cache 13.00 GiB", gpu[0])
        head = forge("info", "llama3.1-8b", "--precision.fp8", "tensorwise", "--precision.fp8_output_head", "true")
        self.assertIn("qkv, o, gate/up and down and of the output head in FP8", head.stdout)
        self.assertNotIn("FP8", forge("info", "llama3.1-8b").stdout)

    def test_info_fp8_routed_experts(self):
        # NOTE [FP8 routed experts switch]: DeepSeek-V2-Lite's routed experts in bf16. The FP8
        # share loses the 6 of 64 experts a token runs through (26 MoE blocks of 3 x 2048 x
        # 1408 each), the weight cache every expert's 2 bytes per weight.
        args = ["info", "deepseek-v2-lite", "--precision.fp8", "tensorwise", "--training.device", "cuda",
                "--training.seq_len", "4096", "--training.local_batch_size", "1"]
        on, off = forge(*args), forge(*args, "--precision.fp8_routed_experts", "false")
        self.assertEqual(off.returncode, 0, off.stderr)

        def line(result, start):
            found = [l for l in result.stdout.splitlines() if l.startswith(start)]
            self.assertEqual(len(found), 1, result.stdout)
            return found[0]
        self.assertIn("block projections and routed experts (each expert its own scales", line(on, "FP8 "))
        self.assertIn("the forward, input- and weight-gradient GEMMs of block projections (the routed experts and the "
                      "router in bf16: precision.fp8_routed_experts false) in FP8", line(off, "FP8 "))
        share = [float(re.search(r"\(([\d.]+)% of the FLOPs per token\)", line(r, "FP8 ")).group(1)) for r in (on, off)]
        flops = float(line(on, "FLOPs per token").split()[3])
        experts = 6 * 26 * 6 * 3 * 2048 * 1408
        self.assertAlmostEqual(share[0] - share[1], 100 * experts / flops, delta=0.11)
        caches = [float(re.search(r"FP8 weight cache ([\d.]+) GiB", line(r, "  one GPU")).group(1)) for r in (on, off)]
        self.assertAlmostEqual(caches[0] - caches[1], 2 * 26 * 64 * 3 * 2048 * 1408 / 2**30, delta=0.02)
        refused = forge("info", "llama3.1-8b", "--precision.fp8", "tensorwise", "--precision.fp8_routed_experts", "false")
        self.assertNotEqual(refused.returncode, 0)
        self.assertIn("this model has none", refused.stderr)

    def test_info_every_model(self):
        models = sorted(f[:-5] for f in os.listdir(os.path.join(source_dir(), "configs", "models")))
        self.assertGreaterEqual(len(models), 10)
        for model in models:
            result = forge("info", model)
            self.assertEqual(result.returncode, 0, f"{model}: {result.stderr}")

    def test_keys_lists_every_section(self):
        out = forge("keys").stdout
        for key in ("training.local_batch_size", "optimizer.lr", "lr_scheduler.warmup_steps", "data.source",
                    "model.rope_scaling.factor", "eval.interval", "logging.run_dir"):
            self.assertIn(key, out)


class BadInput(unittest.TestCase):
    def expect_error(self, args, *fragments):
        result = forge(*args)
        self.assertNotEqual(result.returncode, 0, f"{args} should fail")
        for fragment in fragments:
            self.assertIn(fragment, result.stderr, f"{args}: stderr was:\n{result.stderr}")

    def test_unknown_key_suggests(self):
        self.expect_error(["train", "--training.local_batch_sise", "4"], "training.local_batch_sise",
                          "training.local_batch_size")

    def test_wrong_type(self):
        self.expect_error(["train", "--training.steps", "ten"], "training.steps")

    def test_out_of_range(self):
        self.expect_error(["train", "--training.seq_len", "0"], "training.seq_len")

    def test_inconsistent_batch(self):
        self.expect_error(["train", "--training.local_batch_size", "4", "--training.global_batch_size", "10"],
                          "global_batch_size")

    def test_missing_experiment_file(self):
        self.expect_error(["train", "no-such-experiment.yaml"], "no-such-experiment.yaml")

    def test_unknown_model(self):
        self.expect_error(["info", "llama9"], "llama9")

    def test_dangling_override(self):
        self.expect_error(["train", "--training.steps"], "training.steps")

    def test_bad_yaml(self):
        path = os.path.join(scratch_dir(), "bad.yaml")
        with open(path, "w") as f:
            f.write("training:\n  steps: [1, 2\n")
        self.expect_error(["train", path], "bad.yaml")

    def test_missing_data_file(self):
        self.expect_error(["train", "--data.source", "indexed", "--data.path", "/nonexistent/corpus"],
                          "/nonexistent/corpus")

    def test_existing_run_is_not_overwritten(self):
        run_dir = os.path.join(scratch_dir(), "run")
        self.assertEqual(forge("train", "--training.steps", "1", "--logging.run_dir", run_dir).returncode, 0)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            before = f.read()
        self.expect_error(["train", "--training.steps", "1", "--logging.run_dir", run_dir], "already holds a run")
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            self.assertEqual(f.read(), before)

    def test_unwritable_run_dir_leaves_nothing(self):
        blocker = os.path.join(scratch_dir(), "file")
        with open(blocker, "w") as f:
            f.write("keep me")
        self.expect_error(["train", "--training.steps", "1", "--logging.run_dir", os.path.join(blocker, "run")],
                          blocker)
        with open(blocker) as f:
            self.assertEqual(f.read(), "keep me")


if __name__ == "__main__":
    unittest.main()
