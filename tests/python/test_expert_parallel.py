"""Expert parallelism across real processes on the CPU (forge launch, the CPU process group;
NOTE [Expert parallelism] in src/model/expert_dispatch.h): groups of P ranks split the
routed experts, FSDP shards the rest over every rank and each expert slice over the ranks
that hold it. The loss curves and loads follow one rank's with the global batch kept equal
(Mixtral-style with its balancing loss, DeepSeek-shaped with MLA, a dense first block and
shared experts; ZeRO-1, -2 and -3; P = 2 and 4 of 4 ranks); a checkpoint saved under expert
parallelism holds the same weights as one rank's and resumes on one rank, and its Hugging
Face export is one rank's; forge info sizes a rank's memory by the degree; and the degrees
that cannot work are refused by name. The
model-level equality of gradients (2 and 4 ranks, every checkpointing mode, ranks that
receive no tokens) is tests/cpu/test_model_expert_parallel.cpp."""
import json
import os
import re
import subprocess
import unittest

import numpy

from forge_test_util import forge_bin, scratch_dir
from test_fsdp import STEPS, checkpoint_weights, losses, max_relative_difference, train

EP = "--parallelism.expert_parallel_degree"


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("type") == "train"]


class FollowsOneRank(unittest.TestCase):
    def test_models_degrees_and_stages(self):
        tmp = scratch_dir()
        models = {"moe": ["--model.name", "debug-tiny-moe", "--model.router_aux_loss_coef", "0.01"],
                  "mla": ["--model.name", "debug-tiny-mla"]}
        one = {}
        for name, flags in models.items():
            train(os.path.join(tmp, f"{name}-1"), 1, *flags)
            one[name] = records(os.path.join(tmp, f"{name}-1"))
        for name, ranks, degree, stage in (("moe", 2, 2, 3), ("moe", 4, 4, 3), ("mla", 4, 2, 3), ("mla", 4, 2, 1),
                                           ("mla", 2, 2, 2)):
            with self.subTest(model=name, ranks=ranks, degree=degree, stage=stage):
                run_dir = os.path.join(tmp, f"{name}-{ranks}-ep{degree}-zero{stage}")
                result = train(run_dir, ranks, *models[name], EP, str(degree), "--parallelism.zero_stage", str(stage))
                curve = records(run_dir)
                self.assertLess(max_relative_difference([r["loss"] for r in curve], [r["loss"] for r in one[name]]),
                                1e-4)
                self.assertEqual([r["expert_load"] for r in curve][:3], [r["expert_load"] for r in one[name]][:3])
                self.assertIn(f"expert parallelism {degree}", result.stdout)


class Checkpoints(unittest.TestCase):
    def test_weights_match_one_rank_and_resume_on_one(self):
        tmp = scratch_dir()
        flags = ["--model.name", "debug-tiny-mla", "--checkpoint.enable", "true"]
        single = os.path.join(tmp, "single")
        train(single, 1, *flags, "--training.steps", "15", "--checkpoint.interval", "15")
        split = os.path.join(tmp, "split")
        train(split, 4, *flags, EP, "2", "--checkpoint.interval", "15")
        gap = float(numpy.abs(checkpoint_weights(split, 15) - checkpoint_weights(single, 15)).max())
        self.assertLess(gap, 1e-5)
        uninterrupted = losses(split)
        result = train(split, 1, *flags, "--checkpoint.load_step", "15")
        self.assertIn("saved by 4 ranks", result.stdout)
        resumed = [r["loss"] for r in records(split)[STEPS:]]
        self.assertEqual(len(resumed), STEPS - 15)
        self.assertLess(max(abs(a - b) / b for a, b in zip(resumed, uninterrupted[15:])), 1e-4)


    def test_hugging_face_export_matches_one_rank(self):
        """The export gathers every rank's experts (Fsdp::gather_to_host) into the same
        DeepseekV2ForCausalLM weights one rank writes."""
        from safetensors.numpy import load_file
        tmp = scratch_dir()
        flags = ["--model.name", "debug-tiny-mla", "--training.steps", "3", "--checkpoint.last_save_in_hf", "true",
                 "--checkpoint.export_dtype", "fp32"]
        tensors = {}
        for ranks, degree in ((1, 1), (4, 4)):
            run_dir = os.path.join(tmp, f"ep{degree}")
            train(run_dir, ranks, *flags, EP, str(degree))
            tensors[degree] = load_file(os.path.join(run_dir, "hf", "model.safetensors"))
        self.assertEqual(tensors[1].keys(), tensors[4].keys())
        self.assertIn("model.layers.1.mlp.experts.7.down_proj.weight", tensors[4])
        for name, value in tensors[1].items():
            self.assertLess(float(numpy.abs(tensors[4][name] - value).max()), 1e-6, name)


def info(model, *flags):
    return subprocess.run([forge_bin(), "info", model, *flags], capture_output=True, text=True, timeout=120)


class Configuration(unittest.TestCase):
    def test_info_sizes_a_rank_by_the_degree(self):
        """A rank gathers blocks of 8 experts instead of 64 (its bf16 weights and gradient
        buffers shrink), and may receive every row of its group: dropless, its received-row
        buffers are 8 times a micro-batch's assignments (the activations grow)."""
        base = ["deepseek-v2-lite", "--training.seq_len", "4096", "--training.device", "cuda",
                "--training.local_batch_size", "1", "--parallelism.data_parallel_shard_degree", "8"]
        parts = {}
        for degree in (1, 8):
            result = info(*base, EP, str(degree))
            self.assertEqual(result.returncode, 0, result.stderr)
            line = next(l for l in result.stdout.splitlines() if "one GPU (bf16)" in l)
            parts[degree] = {name: float(re.search(name + r" ([0-9.]+) GiB", line).group(1))
                             for name in ("bf16 weights", "gradients", "activations")}
            if degree > 1:
                self.assertIn("expert parallelism 8 (8 of the 64 routed experts per rank)", result.stdout)
        self.assertLess(parts[8]["bf16 weights"], parts[1]["bf16 weights"] / 2)
        self.assertLess(parts[8]["gradients"], parts[1]["gradients"])
        self.assertGreater(parts[8]["activations"], parts[1]["activations"])

    def test_degrees_that_cannot_work_are_refused(self):
        moe = ["debug-tiny-moe", "--parallelism.data_parallel_shard_degree", "4"]
        for flags, expected in (
                ([*moe, EP, "3"], "parallelism.expert_parallel_degree = 3 (command line) must divide model.num_experts = 4"),
                (["debug-tiny-moe", "--parallelism.data_parallel_shard_degree", "2", EP, "4"],
                 "must divide parallelism.data_parallel_shard_degree = 2"),
                (["debug-tiny", "--parallelism.data_parallel_shard_degree", "2", EP, "2"],
                 "needs a Mixture-of-Experts model (model.num_experts > 0)"),
                (["debug-tiny-moe", "--parallelism.data_parallel_shard_degree", "2",
                  "--parallelism.data_parallel_replicate_degree", "2", EP, "4"],
                 "must divide parallelism.data_parallel_shard_degree = 2"),
                ([*moe, EP, "0"], "parallelism.expert_parallel_degree")):
            with self.subTest(flags=flags):
                result = info(*flags)
                self.assertNotEqual(result.returncode, 0)
                self.assertIn(expected, result.stderr)


if __name__ == "__main__":
    unittest.main()
