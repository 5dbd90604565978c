"""Expert parallelism under pipeline parallelism across real CPU processes (forge launch, the
CPU process group; NOTE [Expert parallelism under pipeline parallelism] in
src/model/pipeline.h): 2 pipeline ranks x 2 data-parallel shard ranks, which form one
expert-parallel group per stage (each rank holding half the routed experts of its stages'
MoE blocks, FSDP ZeRO-1 sharding the rest over the stage's 2 ranks and each expert slice
over the stage's ranks that hold it), follow one rank with the global batch kept equal:
a Mixtral-like debug-tiny-moe (4 blocks, softmax routing, the per-layer balancing loss and
the z-loss) and a DeepSeek-like debug-tiny-mla (4 blocks: MLA, a dense first block, MoE
blocks with a shared expert, sigmoid routing with the routing biases' update, which takes
every stage's loads summed over the data-parallel ranks and the pipeline), under 1F1B and the interleaved schedule: the losses,
gradient norms and validation losses at every step, the expert loads of the first steps
(exact), the final weights of the checkpoint and the Hugging Face export (written in pieces,
each rank its own expert slices). A checkpoint saved under pipeline x expert
parallelism resumes on one rank, and one rank's under pipeline x expert parallelism, each
continuing the run that saved it; the pooled balancing loss (its statistics carried across
the stages, each rank's own tokens') under 1F1B and the interleaved schedule; forge info
sizes a pipeline rank by the degree; under ZeRO-2 and ZeRO-3 (NOTE [ZeRO-2 and -3 under
pipeline parallelism]) both models follow one rank too (LoRA and QLoRA there:
test_lora_pipeline_expert_parallel.py); the configurations still refused name their keys.

The interleaved runs recompute every block (full activation checkpointing), so the
recomputed forwards dispatch again; FP8 (tensorwise and delayed) follows the one-rank FP8
run, rank 0's checkpoint holding every block's and expert's delayed histories.

Measured (20 steps), the largest relative differences from one rank: losses 1.1e-7,
gradient norms 7.2e-8, validation losses 7.4e-8; the final weights 4.2e-7 absolute; the
expert loads of the first 5 steps equal. Routing is discrete, so the bound is
test_pipeline_moe_mla.py's 1e-5. FP8 (10 steps): losses 1.4e-4 (tensorwise) and 4.5e-4
(delayed) from one rank's FP8 run, the bound test_fp8_pipeline_parallel.py's 2e-3."""
import json
import os
import re
import subprocess
import unittest

from forge_test_util import (expect_moe_run_follows, expect_resumes_under_layouts, forge_bin,
                             max_relative_difference, records, scratch_dir, train_on_ranks)

STEPS = 20
TOLERANCE = 1e-5
PP2_EP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
           "--parallelism.expert_parallel_degree", "2", "--parallelism.zero_stage", "1"]
# With full activation checkpointing: the recomputed forwards dispatch again, in the
# schedule's order on every rank of a group alike.
INTERLEAVED = ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", "--activation_checkpoint.mode", "full"]
CHECKPOINTS = ["--checkpoint.enable", "true", "--checkpoint.interval", str(STEPS // 2)]
EXPORT = ["--checkpoint.last_save_in_hf", "true", "--checkpoint.export_dtype", "fp32"]
MODELS = {
    "mixtral": ["--model.name", "debug-tiny-moe", "--model.num_layers", "4", "--model.router_aux_loss_coef", "0.01",
                "--model.router_aux_loss_type", "per_layer", "--model.router_z_loss_coef", "0.001"],
    "deepseek": ["--model.name", "debug-tiny-mla", "--model.num_layers", "4", "--model.router_score_function",
                 "sigmoid", "--model.router_bias_update_rate", "0.001"],
}


class PipelineTimesExpertParallel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()

    def expect_follows(self, run, one):
        # NOTE [Export in pieces]: every rank writes its stages' chunks, its expert slices at
        # their experts' places, into one rank's Hugging Face files.
        expect_moe_run_follows(self, run, one, STEPS, TOLERANCE)

    def test_follows_one_rank_and_resumes_on_one(self):
        for model, flags in MODELS.items():
            one = os.path.join(self.tmp, f"{model}-one")
            train_on_ranks(one, 1, 1, *flags, *CHECKPOINTS, *EXPORT, steps=STEPS)
            trained = records(one, "train")
            self.assertLess(trained[-1]["loss"], trained[0]["loss"] - 0.1, model)
            for name, schedule, log in (("pp2-ep2", [], "pipeline rank 1 of 2: blocks 2-3 and the head"),
                                        ("pp2-ep2-interleaved", INTERLEAVED,
                                         "pipeline rank 0 of 2: blocks 0, 2 and the embedding")):
                with self.subTest(model=model, run=name):
                    run = os.path.join(self.tmp, f"{model}-{name}")
                    result = train_on_ranks(run, 4, 2, *flags, *PP2_EP2, *schedule, *CHECKPOINTS, *EXPORT,
                                            steps=STEPS)
                    self.assertIn(log, result.stdout + result.stderr)
                    self.assertIn("expert parallelism 2: routed experts 0-", result.stdout + result.stderr)
                    self.expect_follows(run, one)
            # The pipeline x expert-parallel checkpoint of step 10 (its files by the 2 shard
            # ranks) resumed on one rank, and one rank's resumed under pipeline x expert
            # parallelism (interleaved): steps 11-20 are the saving run's. The copies hold
            # the evaluations of steps 10 and 20, then the resumed run's of step 20.
            expect_resumes_under_layouts(
                self, self.tmp, model, flags,
                (("resumed on one rank", f"{model}-pp2-ep2", 1, 1, [], "saved by 2 ranks"),
                 ("resumed under pp2 x ep2", f"{model}-one", 4, 2, PP2_EP2 + INTERLEAVED, "saved by 1 rank")),
                TOLERANCE, steps=STEPS)

    def test_pooled_balancing_loss_follows_one_rank(self):
        # NOTE [Pooled balancing loss across stages]: each expert-parallel (data-parallel)
        # rank's pipeline carries its own tokens' statistics, as one rank's micro-batch.
        # Measured (20 steps): losses 5.8e-8, gradient norms 3.8e-8, validation losses 6.8e-8.
        flags = ["--model.name", "debug-tiny-moe", "--model.num_layers", "4", "--model.router_aux_loss_coef", "0.02",
                 "--model.router_aux_loss_type", "pooled"]
        one = os.path.join(self.tmp, "pooled-one")
        train_on_ranks(one, 1, 1, *flags, steps=STEPS)
        for name, schedule in (("pp2-ep2", []), ("pp2-ep2-interleaved", INTERLEAVED)):
            with self.subTest(run=name):
                run = os.path.join(self.tmp, f"pooled-{name}")
                train_on_ranks(run, 4, 2, *flags, *PP2_EP2, *schedule, steps=STEPS)
                for kind, key in (("train", "loss"), ("train", "grad_norm"), ("eval", "loss")):
                    self.assertLess(max_relative_difference(records(run, kind), records(one, kind), key), TOLERANCE,
                                    key)

    def test_zero2_and_zero3_follow_one_rank(self):
        # NOTE [ZeRO-2 and -3 under pipeline parallelism]: the stages' expert parts gathered
        # (ZeRO-3) and reduce-scattered (ZeRO-2/3) over their groups around every use.
        # Measured (Mixtral-like, 20 steps): losses 1.1e-7, gradient norms 1.1e-7.
        for model, flags in MODELS.items():
            one = os.path.join(self.tmp, f"{model}-zero-one")
            train_on_ranks(one, 1, 1, *flags, steps=STEPS)
            for name, zero, schedule in (("zero2", "2", []), ("zero3-interleaved", "3", INTERLEAVED)):
                with self.subTest(model=model, run=name):
                    run = os.path.join(self.tmp, f"{model}-pp2-ep2-{name}")
                    result = train_on_ranks(run, 4, 2, *flags, *PP2_EP2[:-1], zero, *schedule, steps=STEPS)
                    self.assertIn(f"(ZeRO-{zero}, 2 shard ranks x 1 replicas, expert parallelism 2",
                                  result.stdout + result.stderr)
                    for kind in ("train", "eval"):
                        self.assertLess(max_relative_difference(records(run, kind), records(one, kind), "loss"),
                                        TOLERANCE)
                    self.assertLess(max_relative_difference(records(run, "train"), records(one, "train"),
                                                            "grad_norm"), TOLERANCE)

    def test_fp8_follows_one_rank(self):
        # FP8 (NOTE [FP8 routed experts under expert parallelism] in src/ops/moe_fp8.h, NOTE
        # [FP8 under context and pipeline parallelism]): each rank quantizes its local
        # experts' received rows; the delayed statistics are max-reduced over the stage's
        # ranks, then the pipeline, so rank 0's checkpoint holds every block's and every
        # expert's histories, as one rank's does. Not bitwise one rank's (an expert's current
        # scale takes the amax of both ranks' rows at once): the bound is
        # test_fp8_pipeline_parallel.py's 2e-3.
        for recipe in ("tensorwise", "delayed"):
            with self.subTest(recipe=recipe):
                flags = [*MODELS["mixtral"], "--precision.fp8", recipe, "--precision.fp8_amax_history_len", "8",
                         "--checkpoint.enable", "true", "--checkpoint.interval", "10", "--eval.interval", "0"]
                one = os.path.join(self.tmp, f"fp8-{recipe}-one")
                train_on_ranks(one, 1, 1, *flags, steps=10)
                run = os.path.join(self.tmp, f"fp8-{recipe}-pp2-ep2")
                train_on_ranks(run, 4, 2, *flags, *PP2_EP2, steps=10)
                gap = max_relative_difference(records(run, "train"), records(one, "train"), "loss")
                print(f"fp8 {recipe} pp2 x ep2 losses: {gap:.2e}")
                self.assertLess(gap, 2e-3)
                if recipe == "delayed":
                    states = []
                    for run_dir in (one, run):
                        with open(os.path.join(run_dir, "checkpoints", "step-10", "metadata.json")) as f:
                            states.append(json.load(f)["fp8_delayed"]["histories"])
                    self.assertEqual(len(states[1]), len(states[0]))
                    self.assertEqual([h == 0 for h in states[1]], [h == 0 for h in states[0]])

    def test_info_sizes_a_pipeline_rank_by_the_degree(self):
        """A pipeline rank's full-size buffers hold its stages' blocks with 8 of the 64
        experts each (its bf16 weights and gradient buffers shrink; the sharded masters and
        AdamW state are 1/8 of its stages' either way), and its received-row buffers may take
        every row of its group (the activations grow), as without pipelining
        (test_expert_parallel.py)."""
        base = ["deepseek-v2-lite", "--model.num_layers", "26", "--training.seq_len", "4096", "--training.device",
                "cuda", "--training.local_batch_size", "1", "--parallelism.data_parallel_shard_degree", "8",
                "--parallelism.pipeline_parallel_degree", "2", "--parallelism.zero_stage", "1"]
        parts = {}
        for degree in (1, 8):
            result = subprocess.run([forge_bin(), "info", *base, "--parallelism.expert_parallel_degree", str(degree)],
                                    capture_output=True, text=True, timeout=120)
            self.assertEqual(result.returncode, 0, result.stderr)
            line = next(l for l in result.stdout.splitlines() if "one GPU (bf16)" in l)
            parts[degree] = {name: float(re.search(name + r" ([0-9.]+) GiB", line).group(1))
                             for name in ("master weights", "bf16 weights", "gradients", "AdamW state", "activations")}
            if degree > 1:
                self.assertIn("expert parallelism 8 (8 of the 64 routed experts per rank)", result.stdout)
        self.assertLess(parts[8]["bf16 weights"], parts[1]["bf16 weights"] / 2)
        self.assertLess(parts[8]["gradients"], parts[1]["gradients"] / 2)
        self.assertEqual(parts[8]["master weights"], parts[1]["master weights"])
        self.assertEqual(parts[8]["AdamW state"], parts[1]["AdamW state"])
        self.assertGreater(parts[8]["activations"], parts[1]["activations"])

    def test_refused_configurations_name_their_keys(self):
        moe = MODELS["mixtral"]
        for flags, words in (
                # EP groups are formed from a stage's shard ranks.
                (moe + ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"],
                 ["parallelism.expert_parallel_degree = 2", "must divide parallelism.data_parallel_shard_degree"]),
                # LoRA and QLoRA run under both, with ZeRO-2/3 too (test_lora_pipeline_expert_parallel.py);
                # the interleaved schedule under ZeRO-3 still takes the micro-batches in groups of the degree.
                (moe + PP2_EP2[:-1] + ["3", "--lora.rank", "4", "--parallelism.pipeline_parallel_schedule",
                                       "Interleaved1F1B", "--training.gradient_accumulation_steps", "3"],
                 ["Interleaved1F1B", "training.gradient_accumulation_steps = 3"])):
            with self.subTest(flags=flags):
                result = subprocess.run([forge_bin(), "train", "--training.steps", "1", "--logging.run_dir",
                                         os.path.join(self.tmp, "refused"), *flags],
                                        capture_output=True, text=True, timeout=120)
                self.assertNotEqual(result.returncode, 0)
                for word in words:
                    self.assertIn(word, result.stderr)


if __name__ == "__main__":
    unittest.main()
