"""LoRA and QLoRA under pipeline parallelism across real CPU processes (forge launch, the CPU
process group; NOTE [LoRA under pipeline parallelism] in model/lora.h), from a Hugging Face
Llama of 4 blocks: 2 pipeline ranks under 1F1B and under the interleaved schedule (2 stages
of one block per rank) give the single-process run's losses, gradient norms, PEFT adapter
(the same tensor names and shapes, the values within fp32 reordering) and merged export on
the same global batch; so does QLoRA (each rank quantizes its stages' projections alone),
and so does a run with adapter dropout (each micro-batch's masks are one process's, however
the schedule orders the micro-batches). On 4 ranks pipelining composes with data (shard and
replicate), tensor and context parallelism, LoRA and QLoRA, and follows one process too (the
frozen FSDP base under ZeRO-2 and ZeRO-3 as well). A
pipeline run resumes bitwise from its checkpoint, its checkpoint resumes on one process and
a one-process checkpoint on 2 pipeline ranks, a PP2 x DP2 checkpoint on one process and on
PP2 x TP2, CP2 and replicate2; what the other degrees refuse is refused under pipelining
too, by name."""
import json
import os
import shutil
import subprocess
import unittest

import numpy as np
import torch
from safetensors.torch import load_file

from hf_tiny import DEBUG_TINY, random_model
from forge_test_util import forge_bin, records, relative_error, run, scratch_dir, train_losses

GLOBAL_BATCH = 8
TIMEOUT = 300
# One process against several: fp32 sums in another order.
LOSS_TOLERANCE = 1e-5
# Adapters after 6 AdamW steps: the update divides by sqrt(v), which magnifies the reordering
# of near-zero gradient entries (B starts at zero); as tests/python/test_lora_parallel.py.
ADAPTER_TOLERANCE = 1e-4
# Under tensor or context parallelism the forward itself is summed in another order (partial
# sums over the ranks, attention over chunks): layer 0's down_proj adapters, whose entries
# are the nearest zero, end 8.5e-4 (TP) and 2.8e-4 (CP) from one process's, with or without
# pipelining (the same values: the pipeline adds no error of its own).
SPLIT_ADAPTER_TOLERANCE = 2e-3
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
INTERLEAVED = ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
QLORA = ["--lora.quantize_base", "nf4"]
# NOTE [LoRA under pipeline parallelism] with the other degrees: 4 ranks, FSDP's frozen base ZeRO-1.
DP2 = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.zero_stage", "1"]
REPLICATE2 = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.zero_stage", "1"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
CP2 = ["--parallelism.context_parallel_degree", "2", "--parallelism.zero_stage", "1"]
SAVE = ["--checkpoint.enable", "true", "--checkpoint.interval", "3"]


class LoraPipelineParallel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.work = scratch_dir()
        cls.base = os.path.join(cls.work, "base")
        model = random_model("llama", dict(DEBUG_TINY, num_hidden_layers=4), seed=7)
        with torch.no_grad():  # matrices N(0, 0.06): a model whose training is not chaotic
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.mul_(0.2)
        model.save_pretrained(cls.base)
        cls.single = cls.train("single", 1)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.work, ignore_errors=True)

    @classmethod
    def train(cls, name, ranks, *extra, steps=6, export=True, data_ranks=1, base=None):
        """LoRA (rank 4, all-linear) on the HF base for `steps` steps on RANKS CPU ranks, micro-batch
        2 and 4 micro-batches over the DATA_RANKS data-parallel ranks (the global batch of 8
        sequences), selective checkpointing; export: the merged model in fp32; base: a forge
        checkpoint folder as the frozen base instead of the HF model."""
        run_dir = os.path.join(cls.work, name)
        args = ["train", "--checkpoint.initial_load_in_hf", "false" if base else "true",
                "--checkpoint.initial_load_path", base or cls.base, *(["--model.num_layers", "4"] if base else []),
                "--activation_checkpoint.mode", "selective", "--training.local_batch_size", "2",
                "--training.gradient_accumulation_steps", str(GLOBAL_BATCH // (2 * data_ranks)),
                "--training.seq_len", "32", "--training.steps", str(steps), "--eval.interval", "3",
                "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_steps", "8", "--logging.run_dir", run_dir,
                "--lora.rank", "4", "--lora.alpha", "8", "--lora.target_modules", "all-linear", *extra]
        if export:
            args += ["--checkpoint.last_save_in_hf", "true", "--checkpoint.export_dtype", "fp32"]
        command = [forge_bin(), *args] if ranks == 1 else [forge_bin(), "launch", "--nproc-per-node", str(ranks),
                                                           "--", *args]
        cls.last = run(command, timeout=TIMEOUT, env=dict(os.environ, FORGE_NUM_THREADS="1"))
        return run_dir

    def adapters(self, run_dir):
        return load_file(os.path.join(run_dir, "adapter", "adapter_model.safetensors"))

    def assert_follows(self, run_dir, single, export=True, adapter_tolerance=ADAPTER_TOLERANCE):
        losses, reference = train_losses(run_dir), train_losses(single)
        self.assertEqual(len(losses), 6)
        self.assertLess(relative_error(np.array(losses), np.array(reference)), LOSS_TOLERANCE)
        norms = [r["grad_norm"] for r in records(run_dir)]
        self.assertLess(relative_error(np.array(norms), np.array([r["grad_norm"] for r in records(single)])),
                        LOSS_TOLERANCE)
        evals = [r["loss"] for r in records(run_dir, "eval")]
        self.assertEqual(len(evals), 2)
        self.assertLess(relative_error(np.array(evals), np.array([r["loss"] for r in records(single, "eval")])),
                        LOSS_TOLERANCE)
        mine, theirs = self.adapters(run_dir), self.adapters(single)
        self.assertEqual(sorted(mine), sorted(theirs), "the PEFT adapter's tensors")
        for name in theirs:
            self.assertEqual(mine[name].shape, theirs[name].shape, name)
            self.assertLess(relative_error(mine[name].numpy(), theirs[name].numpy()), adapter_tolerance, name)
        self.assertTrue(any(float(t.abs().max()) > 0 for n, t in mine.items() if "lora_B" in n), "B did not train")
        for layer in range(4):  # every stage's adapters trained and reached rank 0's file
            self.assertGreater(float(mine[f"base_model.model.model.layers.{layer}.mlp.down_proj.lora_B.weight"]
                                     .abs().max()), 0, layer)
        with open(os.path.join(run_dir, "adapter", "adapter_config.json")) as f, \
                open(os.path.join(single, "adapter", "adapter_config.json")) as g:
            self.assertEqual(f.read(), g.read())
        if not export:
            return
        merged = load_file(os.path.join(run_dir, "hf", "model.safetensors"))
        reference_merged = load_file(os.path.join(single, "hf", "model.safetensors"))
        self.assertEqual(sorted(merged), sorted(reference_merged))
        for name in reference_merged:
            self.assertLess(relative_error(merged[name].numpy(), reference_merged[name].numpy()), adapter_tolerance,
                            name)

    def test_pipeline_ranks_follow_one_process(self):
        for name, flags in (("pp2", PP2), ("pp2-interleaved", PP2 + INTERLEAVED)):
            with self.subTest(run=name):
                run_dir = self.train(name, 2, *flags)
                self.assertIn("pipeline rank 0 of 2", self.last.stdout + self.last.stderr)
                self.assert_follows(run_dir, self.single)

    def test_pipeline_composes_with_data_context_and_tensor_parallelism(self):
        """4 ranks: 2 pipeline ranks of 2 data-parallel (shard or replicate: FSDP's frozen base
        over each stage's ranks, ZeRO-1), 2 tensor-parallel or 2 context-parallel ranks each,
        and 8: PP2 x TP2 x DP2; the adapters whole everywhere, their gradients summed over
        every group."""
        for name, ranks, data_ranks, flags, tolerance in (
                ("pp2-dp2", 4, 2, PP2 + DP2, ADAPTER_TOLERANCE),
                ("pp2-replicate2", 4, 2, PP2 + REPLICATE2, ADAPTER_TOLERANCE),
                ("pp2-interleaved-dp2", 4, 2, PP2 + INTERLEAVED + DP2, ADAPTER_TOLERANCE),
                ("pp2-tp2", 4, 1, PP2 + TP2, SPLIT_ADAPTER_TOLERANCE),
                ("pp2-cp2", 4, 1, PP2 + CP2, SPLIT_ADAPTER_TOLERANCE),
                ("pp2-tp2-dp2", 8, 2, PP2 + TP2 + DP2, SPLIT_ADAPTER_TOLERANCE)):
            with self.subTest(run=name):
                run_dir = self.train(name, ranks, *flags, data_ranks=data_ranks)
                self.assertIn("pipeline rank 0 of 2", self.last.stdout + self.last.stderr)
                self.assert_follows(run_dir, self.single, adapter_tolerance=tolerance)

    def test_frozen_base_under_zero2_and_zero3(self):
        """NOTE [ZeRO-2 and -3 under pipeline parallelism] with NOTE [Frozen FSDP base]: the
        stages' frozen blocks gathered around each use (ZeRO-3; ZeRO-2 holds them as ZeRO-1)."""
        for name, flags in (("pp2-dp2-zero3", PP2 + DP2[:-1] + ["3"]),
                            ("pp2-interleaved-dp2-zero3", PP2 + INTERLEAVED + DP2[:-1] + ["3"]),
                            ("pp2-dp2-zero2", PP2 + DP2[:-1] + ["2"])):
            with self.subTest(run=name):
                run_dir = self.train(name, 4, *flags, data_ranks=2)
                self.assertIn(f"(ZeRO-{flags[-1]}, 2 shard ranks x 1 replicas), LoRA", self.last.stdout + self.last.stderr)
                self.assert_follows(run_dir, self.single)

    def test_qlora_under_pipeline_parallelism_follows_one_process(self):
        single = self.train("qlora1", 1, *QLORA)
        for name, ranks, data_ranks, flags in (
                ("qlora-pp2", 2, 1, PP2), ("qlora-pp2-interleaved", 2, 1, PP2 + INTERLEAVED),
                ("qlora-pp2-dp2", 4, 2, PP2 + DP2), ("qlora-pp2-cp2", 4, 1, PP2 + CP2)):
            with self.subTest(run=name):
                self.assert_follows(self.train(name, ranks, *flags, *QLORA, data_ranks=data_ranks), single,
                                    adapter_tolerance=SPLIT_ADAPTER_TOLERANCE if "cp2" in name else ADAPTER_TOLERANCE)

    def test_dropout_masks_are_one_processes(self):
        dropout = ["--lora.dropout", "0.1"]
        single = self.train("dropout1", 1, *dropout, export=False)
        self.assertNotEqual(train_losses(single)[1:], train_losses(self.single)[1:], "the dropout changed the steps")
        for name, flags in (("dropout-pp2", PP2), ("dropout-pp2-interleaved", PP2 + INTERLEAVED)):
            with self.subTest(run=name):
                self.assert_follows(self.train(name, 2, *flags, *dropout, export=False), single, export=False)

    def test_resume_is_bitwise_and_crosses_layouts(self):
        dropout = ["--lora.dropout", "0.1"]
        straight = self.train("ckpt-straight", 2, *PP2, *SAVE, *dropout, export=False)
        resumed = self.train("ckpt-resumed", 2, *PP2, *SAVE, *dropout, steps=3, export=False)
        self.train("ckpt-resumed", 2, *PP2, *SAVE, *dropout, export=False)
        self.assertIn("resuming from checkpoint", self.last.stdout + self.last.stderr)
        self.assertEqual(train_losses(straight), train_losses(resumed))
        for name, tensor in self.adapters(straight).items():
            self.assertTrue(bool((tensor == self.adapters(resumed)[name]).all()), name)
        single = self.train("ckpt-single", 1, *SAVE, *dropout, export=False)
        for name, ranks, flags, source, reference in (
                ("pp2-then-one", 1, [], straight, straight),
                ("pp2-then-interleaved", 2, PP2 + INTERLEAVED, straight, straight),
                ("one-then-pp2", 2, PP2, single, single)):
            with self.subTest(layout=name):
                saved = os.path.join(self.work, f"{name}-checkpoints")
                shutil.copytree(os.path.join(source, "checkpoints"), saved)
                tail = self.train(name, ranks, *flags, "--checkpoint.enable", "true", "--checkpoint.folder", saved,
                                  "--checkpoint.load_step", "3", *dropout, export=False)
                self.assertIn("resuming from checkpoint", self.last.stdout + self.last.stderr)
                self.assertLess(relative_error(np.array(train_losses(tail)), np.array(train_losses(reference)[3:])),
                                LOSS_TOLERANCE)


    def test_a_composed_checkpoint_resumes_under_other_layouts(self):
        """A PP2 x DP2 run's checkpoint (the whole adapters, rank 0's) resumes on one process, on
        PP2 x TP2 and on PP2 x CP2 and follows the uninterrupted one-process run."""
        saved_run = self.train("ckpt-pp2-dp2", 4, *PP2, *DP2, *SAVE, data_ranks=2, export=False)
        reference = train_losses(self.single)
        self.assertLess(relative_error(np.array(train_losses(saved_run)), np.array(reference)), LOSS_TOLERANCE)
        for name, ranks, data_ranks, flags in (("pp2dp2-then-one", 1, 1, []),
                                                ("pp2dp2-then-pp2tp2", 4, 1, PP2 + TP2),
                                                ("pp2dp2-then-pp2cp2", 4, 1, PP2 + CP2),
                                                ("pp2dp2-then-pp2replicate2", 4, 2, PP2 + REPLICATE2)):
            with self.subTest(layout=name):
                saved = os.path.join(self.work, f"{name}-checkpoints")
                shutil.copytree(os.path.join(saved_run, "checkpoints"), saved)
                tail = self.train(name, ranks, *flags, "--checkpoint.enable", "true", "--checkpoint.folder", saved,
                                  "--checkpoint.load_step", "3", data_ranks=data_ranks, export=False)
                self.assertIn("resuming from checkpoint", self.last.stdout + self.last.stderr)
                self.assertLess(relative_error(np.array(train_losses(tail)), np.array(reference[3:])),
                                LOSS_TOLERANCE)

    def test_a_forge_checkpoint_as_the_base_of_composed_layouts(self):
        """A full run's checkpoint as the frozen base: each rank reads its stages' parameters (its
        shards of them under TP, its FSDP chunks under DP)."""
        full = os.path.join(self.work, "full")
        run([forge_bin(), "train", "--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_path",
             self.base, "--training.steps", "2", "--training.seq_len", "32", "--eval.interval", "0",
             "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--logging.run_dir", full],
            timeout=TIMEOUT, env=dict(os.environ, FORGE_NUM_THREADS="1"))
        saved = os.path.join(full, "checkpoints")
        one = train_losses(self.train("ckpt-base-one", 1, export=False, base=saved))
        self.assertNotEqual(one, train_losses(self.single), "the checkpoint's base, not the HF one")
        for name, data_ranks, flags in (("pp2-dp2", 2, PP2 + DP2), ("pp2-tp2", 1, PP2 + TP2)):
            with self.subTest(run=name):
                losses = train_losses(self.train(f"ckpt-base-{name}", 4, *flags, export=False, base=saved,
                                                 data_ranks=data_ranks))
                self.assertLess(relative_error(np.array(losses), np.array(one)), LOSS_TOLERANCE)


# NOTE [FP8 frozen base] under pipeline parallelism: the loss tolerance of LoRA FP8 over FSDP
# (tests/python/test_fp8_fsdp.py).
FP8_TOLERANCE = 1e-3


def delayed_state(run_dir):
    with open(os.path.join(run_dir, "checkpoints", "step-6", "metadata.json")) as f:
        return json.load(f)["fp8_delayed"]


class LoraFp8Pipeline(unittest.TestCase):
    """LoRA with the frozen base's forward and input-gradient GEMMs in FP8 on 2 pipeline ranks
    (each building its stages' projections), on PP2 x DP2 (over FSDP's frozen base) and on
    PP2 x TP2 (the amaxes agreed over the tensor-parallel ranks) follows one process's LoRA FP8
    run; with `delayed` the histories are one process's. (Over ZeRO-2 and -3 stages:
    tests/python/test_fp8_pipeline_zero.py.)"""
    train = classmethod(LoraPipelineParallel.train.__func__)

    @classmethod
    def setUpClass(cls):
        LoraPipelineParallel.setUpClass.__func__(cls)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.work, ignore_errors=True)

    def test_pipeline_ranks_follow_one_process(self):
        for recipe in ("tensorwise", "delayed"):
            fp8 = ["--precision.fp8", recipe, "--checkpoint.enable", "true", "--checkpoint.interval", "6"]
            single = self.train(f"fp8-{recipe}-one", 1, *fp8, export=False)
            self.assertIn("frozen base's", self.last.stdout)
            for name, ranks, data_ranks, flags in (("pp2", 2, 1, PP2), ("pp2-dp2", 4, 2, PP2 + DP2),
                                                   ("pp2-tp2", 4, 1, PP2 + TP2)):
                with self.subTest(recipe=recipe, run=name):
                    run_dir = self.train(f"fp8-{recipe}-{name}", ranks, *flags, *fp8, data_ranks=data_ranks,
                                         export=False)
                    self.assertIn("frozen base's", self.last.stdout + self.last.stderr)
                    losses, reference = train_losses(run_dir), train_losses(single)
                    self.assertEqual(len(losses), 6)
                    self.assertLess(relative_error(np.array(losses), np.array(reference)), FP8_TOLERANCE)
                    if name == "pp2":
                        # The same micro-batches as one process, each scaled alike: the adapters follow
                        # it closely. (A data-parallel rank's micro-batches hold other sequences, whose
                        # activations tensorwise scales by their own amaxes: FP8's rounding, as under
                        # FSDP, where the losses are what is compared. Tensor-parallel ranks add their
                        # partial input gradients in bf16 before the next FP8 cast, which moves codes
                        # across rounding boundaries: the first block's adapters, at the end of the
                        # backward chain, end 5-10% apart after 6 steps, as under tensor parallelism
                        # without pipelining; the losses are compared.)
                        mine = load_file(os.path.join(run_dir, "adapter", "adapter_model.safetensors"))
                        theirs = load_file(os.path.join(single, "adapter", "adapter_model.safetensors"))
                        for tensor in theirs:
                            self.assertLess(relative_error(mine[tensor].numpy(), theirs[tensor].numpy()),
                                            SPLIT_ADAPTER_TOLERANCE, tensor)
                    # Under tensor parallelism the histories agree with one process's to fp32
                    # rounding after the first step (5e-7, measured) and then drift as the
                    # gradients do (2.2% after 6 steps, as TP2 without pipelining): compared
                    # for the pipeline's own layouts.
                    if recipe != "delayed" or name == "pp2-tp2":
                        continue
                    state = [delayed_state(d) for d in (run_dir, single)]
                    self.assertTrue(state[0]["active"])
                    self.assertEqual([h == 0 for h in state[0]["histories"]], [h == 0 for h in state[1]["histories"]])
                    self.assertLess(relative_error(np.array(state[0]["histories"]), np.array(state[1]["histories"])),
                                    1e-5)


class Errors(unittest.TestCase):
    def test_what_cannot_be_combined_is_named(self):
        lora = ["--lora.rank", "4", "--model.num_layers", "4", *PP2]
        for ranks, flags, words in (
                # The frozen base runs under ZeRO-3 (and FP8 there: test_fp8_pipeline_zero.py); the
                # interleaved schedule still takes the micro-batches in groups of the degree.
                (4, lora + ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.zero_stage", "3",
                            *INTERLEAVED, "--training.gradient_accumulation_steps", "3"],
                 ["Interleaved1F1B", "training.gradient_accumulation_steps = 3"]),
                (4, lora + TP2 + QLORA,
                 # debug-tiny's o shards (32 columns) would cut NF4's blocks of 64.
                 ["parallelism.tensor_parallel_degree = 2", "with lora.quantize_base = nf4",
                  "each rank quantizes its 32 columns of layers.0"])):
            with self.subTest(flags=flags):
                result = subprocess.run([forge_bin(), "launch", "--nproc-per-node", str(ranks), "--", "train",
                                         "--training.steps", "1", "--logging.run_dir",
                                         os.path.join(scratch_dir(), "refused"), *flags],
                                        capture_output=True, text=True, timeout=TIMEOUT,
                                        env=dict(os.environ, FORGE_NUM_THREADS="1"))
                self.assertNotEqual(result.returncode, 0)
                for word in words:
                    self.assertIn(word, result.stdout + result.stderr)


if __name__ == "__main__":
    unittest.main()
