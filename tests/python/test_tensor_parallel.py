"""Tensor parallelism with sequence parallelism across real processes on the CPU (forge
launch, the CPU process group; NOTE [Tensor parallelism] in model/tensor_parallel.h): the
same run on 2 and 4 tensor-parallel ranks, and on 2 tensor-parallel ranks times 2
data-parallel ranks (FSDP ZeRO-3 and ZeRO-1, hybrid sharding), gives one rank's loss curve,
gradient norms and validation losses within fp32 reordering; checkpoints hold the whole
model (NOTE [Tensor-parallel checkpoints] in ckpt/checkpoint_layout.h), so a run resumes
bitwise at the layout that saved it and follows the uninterrupted run at any other (2 ranks
to 1 and to 2 x FSDP 2, 1 rank to 2); the Hugging Face export of 2 ranks is one rank's (and
that of FSDP 2, alone and replicated twice: every rank writes its part, none gathers),
and 2 ranks start from a Hugging Face model as one rank does; and the configurations and
inputs tensor parallelism cannot take are refused with errors that name the keys or files."""
import json
import os
import shutil
import unittest

import numpy
from safetensors.numpy import load_file, save_file

from forge_test_util import (expect_continues, max_relative_difference, records, resumed_copy, scratch_dir,
                             train_on_ranks)

STEPS = 30


def train(run_dir, ranks, data_ranks, *overrides, check=True):
    return train_on_ranks(run_dir, ranks, data_ranks, *overrides, steps=STEPS, check=check)


class Parity(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()

    def run_dir(self, name):
        return os.path.join(self.tmp, name)

    def expect_follows(self, reference, run):
        self.assertLess(max_relative_difference(records(run, "train"), records(reference, "train"), "loss"), 1e-5)
        self.assertLess(max_relative_difference(records(run, "train"), records(reference, "train"), "grad_norm"), 1e-5)
        self.assertLess(max_relative_difference(records(run, "eval"), records(reference, "eval"), "loss"), 1e-5)

    def test_tensor_parallel_ranks_follow_one(self):
        one = self.run_dir("one")
        train(one, 1, 1)
        self.assertLess(records(one, "train")[-1]["loss"], records(one, "train")[0]["loss"] - 0.5)  # it trained
        for name, ranks, data_ranks, flags in (
                ("tp2", 2, 1, []),
                ("tp2-fsdp2", 4, 2, ["--parallelism.data_parallel_shard_degree", "2"]),
                ("tp2-fsdp2-zero1", 4, 2, ["--parallelism.data_parallel_shard_degree", "2",
                                           "--parallelism.zero_stage", "1"]),
                ("tp2-replicate2", 4, 2, ["--parallelism.data_parallel_replicate_degree", "2"])):
            with self.subTest(run=name):
                result = train(self.run_dir(name), ranks, data_ranks, "--parallelism.tensor_parallel_degree", "2",
                               *flags)
                self.expect_follows(one, self.run_dir(name))
                self.assertIn(f"tensor-parallel rank 1 of 2 (data-parallel rank 0 of {data_ranks})",
                              result.stdout + result.stderr)

    def test_async_tensor_parallel_follows_one(self):
        """NOTE [Async tensor parallelism]: the blocks' collectives as ring steps under row chunks
        of their GEMMs follow one rank's curve as the collectives do (the ring sums in its own
        order), alone and under FSDP."""
        one = self.run_dir("async-one")
        train(one, 1, 1)
        for name, ranks, data_ranks, flags in (("async-tp2", 2, 1, []), ("async-tp2-fsdp2", 4, 2, FSDP2)):
            with self.subTest(run=name):
                result = train(self.run_dir(name), ranks, data_ranks, *TP2,
                               "--parallelism.enable_async_tensor_parallel", "true", *flags)
                self.expect_follows(one, self.run_dir(name))
                self.assertIn("async: the blocks' all-gathers and reduce-scatters as ring steps",
                              result.stdout + result.stderr)

    def test_four_ranks_split_every_head(self):
        mha = ["--model.name", "debug-tiny-mha"]
        train(self.run_dir("mha-one"), 1, 1, *mha)
        train(self.run_dir("mha-tp4"), 4, 1, *mha, "--parallelism.tensor_parallel_degree", "4",
              "--activation_checkpoint.mode", "full")
        self.expect_follows(self.run_dir("mha-one"), self.run_dir("mha-tp4"))


TP2 = ["--parallelism.tensor_parallel_degree", "2"]
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]
SAVE = ["--checkpoint.enable", "true", "--checkpoint.interval", "15"]
EXPORT = ["--checkpoint.last_save_in_hf", "true", "--checkpoint.export_dtype", "fp32"]


class Checkpoints(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()
        cls.tp2 = os.path.join(cls.tmp, "saved-tp2")
        train(cls.tp2, 2, 1, *TP2, *SAVE)
        cls.one = os.path.join(cls.tmp, "saved-one")
        train(cls.one, 1, 1, *SAVE)
        cls.export_one = os.path.join(cls.tmp, "export-one")
        train(cls.export_one, 1, 1, *EXPORT)

    def resumed(self, source, name, ranks, data_ranks, *flags, check=True):
        """A copy of `source` resumed from its step-15 checkpoint."""
        return resumed_copy(source, os.path.join(self.tmp, name), ranks, data_ranks, *flags, steps=STEPS,
                            check=check)

    def expect_continues(self, source, resumed_train, resumed_eval, tolerance):
        expect_continues(self, source, resumed_train, resumed_eval, tolerance, steps=STEPS)

    def test_a_checkpoint_holds_the_whole_model_once(self):
        step = os.path.join(self.tp2, "checkpoints", "step-15")
        with open(os.path.join(step, "metadata.json")) as f:
            metadata = json.load(f)
        self.assertEqual((metadata["format_version"], metadata["tensor_parallel_degree"], metadata["world_size"]),
                         (2, 2, 2))
        sizes = [os.path.getsize(os.path.join(step, f"rank-{r}.bin")) for r in range(2)]
        self.assertEqual(sum(sizes), 12 * metadata["flat_numel"])  # the norm weights once, in rank 0's file
        self.assertGreater(sizes[0], sizes[1])
        with open(os.path.join(self.one, "checkpoints", "step-15", "metadata.json")) as f:
            self.assertEqual(json.load(f)["format_version"], 1)  # without tensor parallelism: as before

    def test_resume_at_the_layout_that_saved_is_bitwise(self):
        for name, source, ranks, data_ranks, flags in (("tp2-again", self.tp2, 2, 1, TP2),
                                                       ("tp2-fsdp2-again", None, 4, 2, TP2 + FSDP2)):
            with self.subTest(run=name):
                if source is None:  # two shard ranks write into each tensor-parallel rank's files
                    source = os.path.join(self.tmp, "saved-tp2-fsdp2")
                    train(source, ranks, data_ranks, *flags, *SAVE)
                _, steps, evals = self.resumed(source, name, ranks, data_ranks, *flags)
                self.expect_continues(source, steps, evals, 0)

    def test_a_tensor_parallel_checkpoint_resumes_under_other_layouts(self):
        for name, ranks, data_ranks, flags in (("tp2-to-one", 1, 1, []),
                                               ("tp2-to-tp2-fsdp2", 4, 2, TP2 + FSDP2)):
            with self.subTest(run=name):
                result, steps, evals = self.resumed(self.tp2, name, ranks, data_ranks, *flags)
                self.assertIn("saved by 2 ranks, tensor-parallel degree 2", result.stdout + result.stderr)
                self.expect_continues(self.tp2, steps, evals, 1e-5)

    def test_a_one_rank_checkpoint_resumes_on_tensor_parallel_ranks(self):
        _, steps, evals = self.resumed(self.one, "one-to-tp2", 2, 1, *TP2)
        self.expect_continues(self.one, steps, evals, 1e-5)

    def test_hugging_face_export_and_import_are_one_ranks(self):
        # NOTE [Export in pieces]: each rank writes its shards or FSDP chunks, none gathers.
        exports = {}
        hybrid = FSDP2 + ["--parallelism.data_parallel_replicate_degree", "2"]
        layouts = (("export-tp2", 2, 1, TP2), ("export-tp2-fsdp2", 4, 2, TP2 + FSDP2), ("export-fsdp2", 2, 2, FSDP2),
                   ("export-fsdp2-replicated2", 4, 4, hybrid))
        for name, ranks, data_ranks, flags in layouts:
            exports[name] = os.path.join(self.tmp, name)
            result = train(exports[name], ranks, data_ranks, *flags, *EXPORT)
            self.assertIn("the Hugging Face export was written by every rank", result.stdout + result.stderr, name)
        want_dir = os.path.join(self.export_one, "hf")
        want = load_file(os.path.join(want_dir, "model.safetensors"))
        for name, _, _, _ in layouts:
            with self.subTest(export=name):
                got_dir = os.path.join(exports[name], "hf")
                self.assertEqual(sorted(os.listdir(got_dir)), sorted(os.listdir(want_dir)))
                with open(os.path.join(got_dir, "config.json")) as a, open(os.path.join(want_dir, "config.json")) as b:
                    self.assertEqual(json.load(a), json.load(b))
                got = load_file(os.path.join(got_dir, "model.safetensors"))
                self.assertEqual(sorted(got), sorted(want))
                for key, value in want.items():
                    self.assertEqual(got[key].shape, value.shape, key)
                    scale = float(numpy.abs(value).max())
                    self.assertLess(float(numpy.abs(got[key] - value).max()), 1e-5 * scale, key)
        # Weights from that Hugging Face model: two ranks (and two times FSDP 2) train as one does.
        start = ["--checkpoint.initial_load_path", want_dir]
        reference = os.path.join(self.tmp, "from-hf-one")
        train(reference, 1, 1, *start)
        for name, ranks, data_ranks, flags in (("from-hf-tp2", 2, 1, TP2), ("from-hf-tp2-fsdp2", 4, 2, TP2 + FSDP2)):
            with self.subTest(run=name):
                run_dir = os.path.join(self.tmp, name)
                result = train(run_dir, ranks, data_ranks, *flags, *start)
                self.assertIn("tensor-parallel rank 0 of 2 read its shards", result.stdout + result.stderr)
                self.expect_follows_run(reference, run_dir)
        self.assertLess(records(reference, "train")[0]["loss"], records(self.export_one, "train")[0]["loss"])

    def expect_follows_run(self, reference, run):
        for kind, key in (("train", "loss"), ("train", "grad_norm"), ("eval", "loss")):
            self.assertLess(max_relative_difference(records(run, kind), records(reference, kind), key), 1e-5, key)

    def test_bad_inputs_are_refused_naming_them(self):
        result, _, _ = self.resumed(self.tp2, "other-model", 2, 1, *TP2, "--model.ffn_hidden_size", "128", check=False)
        self.assertNotEqual(result.returncode, 0)
        for fragment in ("tensor 'layers.0.mlp.gate_up.weight' (param)", "[384, 64]", "[256, 64]"):
            self.assertIn(fragment, result.stderr)
        # A damaged byte in tensor-parallel rank 1's file, in a piece world rank 0 checks
        # (piece i is checked by rank i mod 2: NOTE [Choosing the checkpoint to resume]).
        damaged = os.path.join(self.tmp, "damaged")
        shutil.copytree(self.tp2, damaged)
        step = os.path.join(damaged, "checkpoints", "step-15")
        with open(os.path.join(step, "metadata.json")) as f:
            pieces = [p for t in json.load(f)["tensors"] for p in t["pieces"]]
        piece = next(p for i, p in enumerate(pieces) if i % 2 == 0 and p["rank"] == 1)
        with open(os.path.join(step, "rank-1.bin"), "r+b") as f:
            f.seek(piece["byte_offset"] + 1)
            byte = f.read(1)[0]
            f.seek(piece["byte_offset"] + 1)
            f.write(bytes([byte ^ 0x01]))
        result = train(damaged, 2, 1, *TP2, *SAVE, "--checkpoint.load_step", "15", check=False)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("rank-1.bin", result.stderr)
        self.assertIn("CRC-32", result.stderr)
        # A Hugging Face model that lacks a tensor.
        incomplete = os.path.join(self.tmp, "hf-incomplete")
        shutil.copytree(os.path.join(self.export_one, "hf"), incomplete)
        weights = load_file(os.path.join(incomplete, "model.safetensors"))
        del weights["model.layers.1.self_attn.o_proj.weight"]
        save_file(weights, os.path.join(incomplete, "model.safetensors"), metadata={"format": "pt"})
        result = train(os.path.join(self.tmp, "from-incomplete"), 2, 1, *TP2, "--checkpoint.initial_load_path",
                       incomplete, check=False)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("no tensor 'model.layers.1.self_attn.o_proj.weight'", result.stderr)


class Errors(unittest.TestCase):
    def expect_refused(self, ranks, flags, message):
        result = train(os.path.join(scratch_dir(), "refused"), ranks, 1, *flags, check=False)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn(message, result.stdout + result.stderr)

    def test_bad_configurations_name_their_keys(self):
        tp = "--parallelism.tensor_parallel_degree"
        for ranks, flags, message in (
                (2, [tp, "3"], "splits the query heads of model debug-tiny (model.num_heads = 4), which 3 does not divide"),
                (2, [tp, "2", "--model.name", "debug-tiny-moe"], "has Mixture-of-Experts blocks"),
                (2, [tp, "2", "--model.name", "debug-tiny-mla"], "has Multi-head Latent Attention"),
                (2, [tp, "2", "--training.local_batch_size", "1", "--training.seq_len", "5"],
                 "must divide the micro-batch's tokens"),
                # QLoRA: debug-tiny's o shards (32 columns) would cut NF4's blocks of 64.
                (2, [tp, "2", "--lora.rank", "4", "--lora.quantize_base", "nf4"],
                 "QLoRA under tensor parallelism over 2 ranks: each rank quantizes its 32 columns of layers.0"),
                (2, [tp, "4", "--model.name", "debug-tiny-mha"], "context_parallel_degree × pipeline_parallel_degree = 1 × 1 × 4 × 1 × 1 = 4"),
                (1, [tp, "2"], "this process was started alone")):
            with self.subTest(flags=flags):
                self.expect_refused(ranks, flags, message)


if __name__ == "__main__":
    unittest.main()
