"""Pipeline parallelism across real processes on the CPU (forge launch, the CPU process group;
NOTE [Pipeline parallelism] in model/pipeline.h): the same run on 2 and 4 pipeline ranks
with the 1F1B schedule and on 2 ranks with the interleaved one (two stages per rank) gives
one rank's loss curve, gradient norms and validation losses within fp32 reordering (so do
2 stages x FSDP 2 under ZeRO-2 and ZeRO-3, with the interleaved schedule, hybrid sharding,
context and tensor parallelism, whose ZeRO-3 checkpoint resumes bitwise, under ZeRO-1 and on one rank;
in FP8 there: test_fp8_pipeline_zero.py); each
rank logs its blocks and the schedule's bubble; every rank writes its stages into one
checkpoint of the whole model, which resumes bitwise at the layout that saved it and
follows the uninterrupted run at another (2 pipeline ranks to 1 and to the interleaved
schedule, 1 rank to 2), and starts a run from its weights; a non-finite gradient on one stage stops
every rank naming the tensor; and the configurations pipelining cannot take are refused
with errors that name the keys."""
import json
import os
import subprocess
import unittest

from forge_test_util import (expect_continues, forge_bin, max_relative_difference, records, resumed_copy,
                             scratch_dir, train_on_ranks)

STEPS = 30
LAYERS = ["--model.num_layers", "4"]
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.zero_stage", "1"]
ZERO2 = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.zero_stage", "2"]
ZERO3 = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.zero_stage", "3"]


def train(run_dir, ranks, *overrides, data_ranks=1, check=True):
    return train_on_ranks(run_dir, ranks, data_ranks, *LAYERS, *overrides, steps=STEPS, check=check)


class Parity(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()
        cls.one = os.path.join(cls.tmp, "one")
        train(cls.one, 1)

    def expect_follows(self, run):
        for kind in ("train", "eval"):
            self.assertLess(max_relative_difference(records(run, kind), records(self.one, kind), "loss"), 1e-5)
        self.assertLess(max_relative_difference(records(run, "train"), records(self.one, "train"), "grad_norm"), 1e-5)

    def test_pipeline_ranks_follow_one(self):
        self.assertLess(records(self.one, "train")[-1]["loss"], records(self.one, "train")[0]["loss"] - 0.5)
        for name, ranks, stages, flags, log in (
                ("pp2", 2, 2, [], "pipeline rank 1 of 2: blocks 2-3 and the head"),
                ("pp4", 4, 4, ["--activation_checkpoint.mode", "selective"],
                 "pipeline rank 0 of 4: block 0 and the embedding"),
                ("pp2-interleaved", 2, 2, ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                                           "--activation_checkpoint.mode", "full"],
                 "pipeline rank 0 of 2: blocks 0, 2 and the embedding"),
                ("pp2-tp2", 4, 2, ["--parallelism.tensor_parallel_degree", "2"],
                 "pipeline rank 1 of 2: blocks 2-3 and the head"),
                ("pp2-fsdp2", 4, 2, FSDP2, "pipeline rank 1 of 2: blocks 2-3 and the head"),
                ("pp2-interleaved-replicate2", 4, 2, ["--parallelism.data_parallel_replicate_degree", "2",
                                                      "--parallelism.zero_stage", "1",
                                                      "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
                 "pipeline rank 1 of 2: blocks 1, 3 and the head"),
                ("pp2-tp2-fsdp2", 8, 2, FSDP2 + ["--parallelism.tensor_parallel_degree", "2"],
                 "pipeline rank 0 of 2: blocks 0-1 and the embedding"),
                # zero_stage left out: 1 by default under pipelining.
                ("pp2-cp2", 4, 2, ["--parallelism.context_parallel_degree", "2"],
                 "pipeline rank 1 of 2: blocks 2-3 and the head"),
                # NOTE [ZeRO-2 and -3 under pipeline parallelism]: per micro-batch reductions and gathers.
                ("pp2-fsdp2-zero3", 4, 2, ZERO3, "(ZeRO-3, 2 shard ranks x 1 replicas)"),
                ("pp2-interleaved-fsdp2-zero2", 4, 2, ZERO2 + ["--parallelism.pipeline_parallel_schedule",
                                                               "Interleaved1F1B"],
                 "(ZeRO-2, 2 shard ranks x 1 replicas)"),
                ("pp2-interleaved-replicate2-zero3", 4, 2, ["--parallelism.data_parallel_replicate_degree", "2",
                                                            "--parallelism.zero_stage", "3",
                                                            "--parallelism.pipeline_parallel_schedule",
                                                            "Interleaved1F1B"],
                 "(ZeRO-3, 1 shard ranks x 2 replicas)"),
                ("pp2-cp2-zero3", 4, 2, ["--parallelism.context_parallel_degree", "2",
                                         "--parallelism.zero_stage", "3"],
                 "(ZeRO-3, 2 shard ranks x 1 replicas)"),
                ("pp2-tp2-fsdp2-zero3", 8, 2, ZERO3 + ["--parallelism.tensor_parallel_degree", "2"],
                 "(ZeRO-3, 2 shard ranks x 1 replicas)")):
            with self.subTest(run=name):
                run = os.path.join(self.tmp, name)
                split = 2 if any(f in flags for f in ("--parallelism.tensor_parallel_degree",
                                                      "--parallelism.context_parallel_degree")) else 1
                data_ranks = ranks // stages // split
                result = train(run, ranks, "--parallelism.pipeline_parallel_degree", str(stages), *flags,
                               data_ranks=data_ranks)
                self.expect_follows(run)
                self.assertIn(log, result.stdout + result.stderr)
                self.assertIn("bubble", result.stdout + result.stderr)


PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
SAVE = ["--checkpoint.enable", "true", "--checkpoint.interval", "15"]


class Checkpoints(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()
        cls.pp2 = os.path.join(cls.tmp, "saved-pp2")
        train(cls.pp2, 2, *PP2, *SAVE)
        cls.one = os.path.join(cls.tmp, "saved-one")
        train(cls.one, 1, *SAVE)

    def resumed(self, source, name, ranks, *flags):
        """A copy of `source` resumed from its step-15 checkpoint: the train and eval records it appended."""
        _, steps, evals = resumed_copy(source, os.path.join(self.tmp, name), ranks, 1, *LAYERS, *flags, steps=STEPS)
        return steps, evals

    def expect_continues(self, source, resumed_train, resumed_eval, tolerance):
        expect_continues(self, source, resumed_train, resumed_eval, tolerance, steps=STEPS)

    def test_every_rank_writes_its_stages_into_one_file(self):
        step = os.path.join(self.pp2, "checkpoints", "step-15")
        with open(os.path.join(step, "metadata.json")) as f:
            metadata = json.load(f)
        self.assertEqual((metadata["format_version"], metadata["world_size"]), (1, 1))
        self.assertEqual(os.path.getsize(os.path.join(step, "rank-0.bin")), 12 * metadata["flat_numel"])
        with open(os.path.join(self.one, "checkpoints", "step-15", "rank-0.bin"), "rb") as a, \
                open(os.path.join(step, "rank-0.bin"), "rb") as b:
            self.assertEqual(len(a.read()), len(b.read()))

    def test_resume_at_the_layout_that_saved_is_bitwise(self):
        steps, evals = self.resumed(self.pp2, "pp2-again", 2, *PP2)
        self.expect_continues(self.pp2, steps, evals, 0)

    def test_pipeline_with_tensor_parallel_checkpoints(self):
        """2 stages x 2 tensor-parallel ranks write each tensor-parallel rank's files (format 2),
        resume bitwise, and resume on one rank."""
        tp = ["--parallelism.tensor_parallel_degree", "2"]
        source = os.path.join(self.tmp, "saved-pp2-tp2")
        train(source, 4, *PP2, *tp, *SAVE)
        with open(os.path.join(source, "checkpoints", "step-15", "metadata.json")) as f:
            metadata = json.load(f)
        self.assertEqual((metadata["format_version"], metadata["tensor_parallel_degree"]), (2, 2))
        steps, evals = self.resumed(source, "pp2-tp2-again", 4, *PP2, *tp)
        self.expect_continues(source, steps, evals, 0)
        steps, evals = self.resumed(source, "pp2-tp2-to-one", 1)
        self.expect_continues(source, steps, evals, 1e-5)

    def test_pipeline_with_fsdp_checkpoints(self):
        """2 stages x FSDP 2 (ZeRO-1): each stage's shard ranks write their chunks into the
        shard files; the run resumes bitwise, and on one rank."""
        source = os.path.join(self.tmp, "saved-pp2-fsdp2")
        train(source, 4, *PP2, *FSDP2, *SAVE, data_ranks=2)
        _, steps, evals = resumed_copy(source, os.path.join(self.tmp, "pp2-fsdp2-again"), 4, 2, *LAYERS, *PP2,
                                       *FSDP2, steps=STEPS)
        self.expect_continues(source, steps, evals, 0)
        steps, evals = self.resumed(source, "pp2-fsdp2-to-one", 1)
        self.expect_continues(source, steps, evals, 1e-5)

    def test_pipeline_with_fsdp_zero3_checkpoints(self):
        """2 stages x FSDP 2 under ZeRO-3 (NOTE [ZeRO-2 and -3 under pipeline parallelism]): the
        run resumes bitwise, under ZeRO-1, and on one rank."""
        source = os.path.join(self.tmp, "saved-pp2-zero3")
        train(source, 4, *PP2, *ZERO3, *SAVE, data_ranks=2)
        _, steps, evals = resumed_copy(source, os.path.join(self.tmp, "pp2-zero3-again"), 4, 2, *LAYERS, *PP2,
                                       *ZERO3, steps=STEPS)
        self.expect_continues(source, steps, evals, 0)
        _, steps, evals = resumed_copy(source, os.path.join(self.tmp, "pp2-zero3-to-zero1"), 4, 2, *LAYERS, *PP2,
                                       *FSDP2, steps=STEPS)
        self.expect_continues(source, steps, evals, 1e-5)
        steps, evals = self.resumed(source, "pp2-zero3-to-one", 1)
        self.expect_continues(source, steps, evals, 1e-5)

    def test_a_pipeline_checkpoint_resumes_under_other_layouts(self):
        for name, ranks, flags in (("pp2-to-one", 1, []),
                                   ("pp2-to-interleaved", 2, PP2 + ["--parallelism.pipeline_parallel_schedule",
                                                                    "Interleaved1F1B"])):
            with self.subTest(run=name):
                steps, evals = self.resumed(self.pp2, name, ranks, *flags)
                self.expect_continues(self.pp2, steps, evals, 1e-5)
        steps, evals = self.resumed(self.one, "one-to-pp2", 2, *PP2)
        self.expect_continues(self.one, steps, evals, 1e-5)

    def test_initial_weights_from_a_checkpoint(self):
        start = ["--checkpoint.initial_load_path", os.path.join(self.one, "checkpoints", "step-30")]
        reference = os.path.join(self.tmp, "from-one")
        train(reference, 1, *start)
        run = os.path.join(self.tmp, "from-one-pp2")
        train(run, 2, *PP2, *start)
        for kind, key in (("train", "loss"), ("train", "grad_norm"), ("eval", "loss")):
            self.assertLess(max_relative_difference(records(run, kind), records(reference, kind), key), 1e-5, key)


class Failures(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()

    def test_nonfinite_gradient_on_one_stage_stops_every_rank(self):
        env = dict(os.environ, FORGE_NUM_THREADS="1",
                   FORGE_TEST_INJECT_NAN="2:layers.3.mlp.down.weight:0")
        run = os.path.join(self.tmp, "nan")
        command = [forge_bin(), "launch", "--nproc-per-node", "2", "--", "train", *LAYERS,
                   "--parallelism.pipeline_parallel_degree", "2", "--training.steps", "4",
                   "--training.gradient_accumulation_steps", "2", "--logging.run_dir", run]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("non-finite step 2", result.stderr + result.stdout)
        self.assertIn("'layers.3.mlp.down.weight'", result.stderr + result.stdout)

    def test_refused_configurations_name_their_keys(self):
        for flags, words in (
                (["--model.num_layers", "3"], ["parallelism.pipeline_parallel_degree", "model.num_layers"]),
                (["--model.num_layers", "4", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                  "--training.gradient_accumulation_steps", "3"],
                 ["Interleaved1F1B", "training.gradient_accumulation_steps"]),
                (["--model.num_layers", "4", "--model.tie_word_embeddings", "true"], ["tie_word_embeddings"]),
                (["--model.num_layers", "4", "--parallelism.pipeline_parallel_layers_per_stage", "1"],
                 ["pipeline_parallel_layers_per_stage", "Interleaved1F1B"])):
            with self.subTest(flags=flags):
                result = subprocess.run([forge_bin(), "train", "--parallelism.pipeline_parallel_degree", "2",
                                         "--training.steps", "1", "--logging.run_dir",
                                         os.path.join(self.tmp, "refused"), *flags],
                                        capture_output=True, text=True, timeout=120)
                self.assertNotEqual(result.returncode, 0)
                for word in words:
                    self.assertIn(word, result.stderr)


if __name__ == "__main__":
    unittest.main()
