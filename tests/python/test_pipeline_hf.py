"""Hugging Face import and export under pipeline parallelism, across real processes on the
CPU (forge launch, the CPU process group; NOTE [Export in pieces] in train/trainer_hf.cpp):
runs started from a tiny random Hugging Face Llama of 4 blocks on 2 pipeline ranks (1F1B
and the interleaved schedule), 2 stages x FSDP 2 (ZeRO-1), 2 stages x 2 tensor-parallel
ranks and 2 stages x 2 context-parallel ranks follow one rank's run from the same folder
(losses, gradient norms and validation losses within 1e-5), each rank reading only its
stages' tensors, and export folders that transformers loads with one rank's exported weights
(within fp32 reordering) and logits; with a zero learning rate 2 stages x 2 tensor-parallel
ranks x FSDP 2 export the source's weights bit for bit, in files byte for byte one rank's;
and a folder missing a tensor of the last stage is refused, naming it."""
import json
import os
import shutil
import unittest

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_tiny import DEBUG_TINY, random_model
from forge_test_util import max_relative_difference, records, scratch_dir, train_on_ranks

STEPS = 10
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
ZERO1 = ["--parallelism.zero_stage", "1"]
EXPORT = ["--checkpoint.last_save_in_hf", "true", "--checkpoint.export_dtype", "fp32"]


def transformers_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens).long()).logits.numpy().astype(np.float64)


class PipelineHuggingFace(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()
        cls.source = os.path.join(cls.tmp, "source")
        model = random_model("llama", dict(DEBUG_TINY, num_hidden_layers=4), seed=5)
        with torch.no_grad():  # matrices N(0, 0.06): a model whose training is not chaotic
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.mul_(0.2)
        model.save_pretrained(cls.source)
        cls.start = ["--checkpoint.initial_load_path", cls.source]
        cls.one = os.path.join(cls.tmp, "one")
        cls.train(cls.one, 1, 1, *cls.start, *EXPORT)

    @staticmethod
    def train(run_dir, ranks, data_ranks, *flags, steps=STEPS):
        return train_on_ranks(run_dir, ranks, data_ranks, *flags, steps=steps)

    def test_pipeline_runs_from_a_hugging_face_model_follow_one_rank_and_export_its_model(self):
        want_dir = os.path.join(self.one, "hf")
        want = transformers_model(want_dir)
        tokens = np.random.RandomState(2).randint(0, DEBUG_TINY["vocab_size"], size=(2, 17))
        want_logits = logits(want, tokens)
        # It trained: the export is not the source.
        source = load_file(os.path.join(self.source, "model.safetensors"))
        self.assertFalse(torch.equal(want.state_dict()["model.layers.3.mlp.down_proj.weight"],
                                     source["model.layers.3.mlp.down_proj.weight"]))
        for name, ranks, data_ranks, flags in (
                ("pp2", 2, 1, PP2),
                ("pp2-interleaved", 2, 1, PP2 + ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
                ("pp2-fsdp2", 4, 2, PP2 + ZERO1 + ["--parallelism.data_parallel_shard_degree", "2"]),
                ("pp2-tp2", 4, 1, PP2 + ["--parallelism.tensor_parallel_degree", "2"]),
                ("pp2-cp2", 4, 1, PP2 + ZERO1 + ["--parallelism.context_parallel_degree", "2"])):
            with self.subTest(run=name):
                run = os.path.join(self.tmp, name)
                result = self.train(run, ranks, data_ranks, *flags, *self.start, *EXPORT)
                output = result.stdout + result.stderr
                self.assertIn("weights: this rank's pipeline stages", output)
                self.assertIn("the Hugging Face export was written by every rank", output)
                for kind, key in (("train", "loss"), ("train", "grad_norm"), ("eval", "loss")):
                    self.assertLess(max_relative_difference(records(run, kind), records(self.one, kind), key), 1e-5,
                                    key)
                got_dir = os.path.join(run, "hf")
                self.assertEqual(sorted(os.listdir(got_dir)), sorted(os.listdir(want_dir)))
                with open(os.path.join(got_dir, "config.json")) as a, open(os.path.join(want_dir, "config.json")) as b:
                    self.assertEqual(json.load(a), json.load(b))
                got = transformers_model(got_dir)
                self.assertEqual(type(got).__name__, "LlamaForCausalLM")
                got_state, want_state = got.state_dict(), want.state_dict()
                self.assertEqual(sorted(got_state), sorted(want_state))
                for key, value in want_state.items():
                    scale = float(value.abs().max())
                    self.assertLess(float((got_state[key] - value).abs().max()), 1e-5 * scale, key)
                got_logits = logits(got, tokens)
                err = float(np.abs(got_logits - want_logits).max() / np.abs(want_logits).max())
                self.assertLess(err, 1e-5, "logits")

    def test_a_still_run_exports_the_source_in_one_ranks_files(self):
        still = ["--optimizer.lr", "0", "--lr_scheduler.decay_style", "linear"]
        one = os.path.join(self.tmp, "still-one")
        self.train(one, 1, 1, *self.start, *EXPORT, *still, steps=2)
        run = os.path.join(self.tmp, "still-pp2-tp2-fsdp2")
        self.train(run, 8, 2, *PP2, *ZERO1, "--parallelism.data_parallel_shard_degree", "2",
                   "--parallelism.tensor_parallel_degree", "2", *self.start, *EXPORT, *still, steps=2)
        names = sorted(os.listdir(os.path.join(one, "hf")))
        self.assertEqual(names, sorted(os.listdir(os.path.join(run, "hf"))))
        for name in names:
            with open(os.path.join(one, "hf", name), "rb") as a, open(os.path.join(run, "hf", name), "rb") as b:
                self.assertEqual(a.read(), b.read(), name)
        source = load_file(os.path.join(self.source, "model.safetensors"))
        exported = load_file(os.path.join(run, "hf", "model.safetensors"))
        self.assertEqual(sorted(source), sorted(exported))
        for key in source:
            self.assertTrue(torch.equal(source[key], exported[key]), key)

    def test_a_tensor_missing_from_the_last_stage_is_refused_naming_it(self):
        damaged = os.path.join(self.tmp, "damaged")
        shutil.copytree(self.source, damaged)
        weights = load_file(os.path.join(damaged, "model.safetensors"))
        del weights["model.layers.3.mlp.down_proj.weight"]
        save_file(weights, os.path.join(damaged, "model.safetensors"), metadata={"format": "pt"})
        result = train_on_ranks(os.path.join(self.tmp, "from-damaged"), 2, 1, *PP2, "--checkpoint.initial_load_path",
                                damaged, steps=2, check=False)
        self.assertNotEqual(result.returncode, 0)
        # (Stage 0's rank checks the tensor too, but the first rank to fail stops the other.)
        self.assertIn(f"error: {damaged}: no tensor 'model.layers.3.mlp.down_proj.weight'", result.stdout + result.stderr)


if __name__ == "__main__":
    unittest.main()
