"""LoRA on a Mixture-of-Experts model under pipeline parallelism together with expert
parallelism, across real CPU processes (forge launch, the CPU process group; NOTE [LoRA under
pipeline and expert parallelism] in src/model/lora.h): 2 pipeline ranks x 2 data-parallel
shard ranks, each stage's 2 ranks one expert-parallel group (each holding half the routed
experts of its stages' MoE blocks, the frozen FSDP base ZeRO-1 over the stage's ranks and
split by experts), with adapters on attention, the router and both expert stacks, follow one
process with the global batch kept equal: a Mixtral-like debug-tiny-moe and a DeepSeek-like
debug-tiny-mla (MLA, a dense first block, shared experts), 4 blocks each. The losses and
gradient norms at every step, the PEFT adapter (rank 0's, the whole adapters: every rank
holds them after the gradients' sums) and the merged Hugging Face export (written in pieces,
each stage's base gathered with every expert's slices) are one process's; the PP2 x EP2
checkpoint resumes on one process and one process's under PP2 x EP2 with the interleaved
schedule, each continuing the run that saved it. QLoRA (each rank's NF4 base its stages' blocks
with its experts alone) follows one process's QLoRA the same way, its merged export written
in pieces with no gather (loaded by transformers, the Mixtral-like one computes one process's
merged model's logits), also under hybrid sharding (8 ranks), and resumes as LoRA's does;
forge info sizes its NF4 base by the experts.
QLoRA measured (10 steps): losses, gradient norms and validation losses within 5.6e-8, the
adapters within 1.2e-5, the merged export within 1.6e-6 (transformers' logits 7.5e-8);
hybrid sharding the same as PP2 x EP2 (7.3e-7 merged export). Under ZeRO-2 and -3 (1F1B and
the interleaved schedule), LoRA and QLoRA are ZeRO-1's runs bitwise."""
import os
import re
import subprocess
import unittest

import numpy

from forge_test_util import (expect_resumes_under_layouts, forge_bin, max_relative_difference, records,
                             relative_error, scratch_dir, train_on_ranks)

STEPS = 10
TOLERANCE = 1e-5
# Adapters after AdamW steps: the update divides by sqrt(v), which magnifies the reordering of
# near-zero gradient entries (B starts at zero); as tests/python/test_lora_pipeline_parallel.py.
ADAPTER_TOLERANCE = 1e-4
PP2_EP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
           "--parallelism.expert_parallel_degree", "2", "--parallelism.zero_stage", "1"]
INTERLEAVED = ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", "--activation_checkpoint.mode", "full"]
QLORA = ["--lora.quantize_base", "nf4"]
# The copies hold the saving run's export.
NO_EXPORT = ["--checkpoint.last_save_in_hf", "false"]
LORA = ["--lora.rank", "4", "--lora.alpha", "8", "--eval.interval", str(STEPS // 2), "--checkpoint.enable", "true",
        "--checkpoint.interval", str(STEPS // 2), "--checkpoint.last_save_in_hf", "true",
        "--checkpoint.export_dtype", "fp32"]
MODELS = {
    "mixtral": ["--model.name", "debug-tiny-moe", "--model.num_layers", "4", "--lora.target_modules",
                "q_proj,o_proj,gate,experts.gate_up_proj,experts.down_proj"],
    "deepseek": ["--model.name", "debug-tiny-mla", "--model.num_layers", "4", "--lora.target_modules",
                 "q_proj,kv_b_proj,o_proj,gate_proj,down_proj,gate,experts.gate_up_proj,experts.down_proj"],
}


def safetensors(path):
    from safetensors.numpy import load_file
    return load_file(path)


class LoraPipelineTimesExpertParallel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()

    def expect_follows(self, run, one):
        for kind, key in (("train", "loss"), ("train", "grad_norm"), ("eval", "loss")):
            gap = max_relative_difference(records(run, kind), records(one, kind), key)
            print(f"{os.path.basename(run)} {kind} {key}: {gap:.2e}")
            self.assertLess(gap, TOLERANCE, key)
        mine, theirs = (safetensors(os.path.join(d, "adapter", "adapter_model.safetensors")) for d in (run, one))
        self.assertEqual(sorted(mine), sorted(theirs), "the PEFT adapter's tensors")
        self.assertTrue(any("experts" in name for name in theirs), "no expert adapters")
        gap = 0.0
        for name, value in theirs.items():
            self.assertEqual(mine[name].shape, value.shape, name)
            gap = max(gap, relative_error(mine[name], value))
            self.assertLess(relative_error(mine[name], value), ADAPTER_TOLERANCE, name)
        print(f"{os.path.basename(run)} adapters: {gap:.2e}")
        # Every expert's B trained (the other ranks' experts reached rank 0's file).
        for name, value in mine.items():
            if "experts" in name and "lora_B" in name:
                experts = value.reshape(-1, value.shape[-1]) if value.ndim > 2 else value
                self.assertGreater(float(numpy.abs(experts).max()), 0, name)
        mine, theirs = (safetensors(os.path.join(d, "hf", "model.safetensors")) for d in (run, one))
        self.assertEqual(sorted(mine), sorted(theirs))
        gap = max(relative_error(mine[name], value) for name, value in theirs.items())
        print(f"{os.path.basename(run)} merged export: {gap:.2e}")
        self.assertLess(gap, ADAPTER_TOLERANCE)

    def test_follows_one_process_and_resumes_across_layouts(self):
        for model, flags in MODELS.items():
            with self.subTest(model=model):
                one = os.path.join(self.tmp, f"{model}-one")
                train_on_ranks(one, 1, 1, *flags, *LORA, steps=STEPS)
                run = os.path.join(self.tmp, f"{model}-pp2-ep2")
                result = train_on_ranks(run, 4, 2, *flags, *LORA, *PP2_EP2, steps=STEPS)
                self.assertIn("pipeline rank 1 of 2: blocks 2-3 and the head", result.stdout + result.stderr)
                self.expect_follows(run, one)
                # The PP2 x EP2 checkpoint of step 5 (the whole adapters, rank 0's) resumed on
                # one process, and one process's under PP2 x EP2 with the interleaved schedule:
                # steps 6-10 are the saving run's.
                expect_resumes_under_layouts(
                    self, self.tmp, model, [*flags, *LORA],
                    (("resumed on one process", f"{model}-pp2-ep2", 1, 1, NO_EXPORT, "saved by 1 rank"),
                     ("resumed under pp2 x ep2 interleaved", f"{model}-one", 4, 2,
                      PP2_EP2 + INTERLEAVED + NO_EXPORT, "saved by 1 rank")),
                    TOLERANCE, steps=STEPS)

    def test_zero2_and_zero3_follow_one_process_and_zero1(self):
        """ZeRO-2 and -3 over the stages (NOTE [ZeRO-2 and -3 under pipeline parallelism] in
        src/distributed/fsdp.h): LoRA's frozen base under ZeRO-3 gathered per use, its expert
        parts over the ranks that hold the same experts (NOTE [Frozen FSDP base]), under 1F1B
        and the interleaved schedule; QLoRA's NF4 base is each rank's whatever the ZeRO stage.
        The base has no gradients and the adapters' are summed as under ZeRO-1 (each stage's
        micro-batches in order under either schedule), so each run is the ZeRO-1 run's bitwise,
        and follows one process as it does."""
        flags = MODELS["mixtral"]
        for kind, extra in (("lora", []), ("qlora", QLORA)):
            one = os.path.join(self.tmp, f"zero-{kind}-one")
            train_on_ranks(one, 1, 1, *flags, *extra, *LORA, steps=STEPS)
            zero1 = os.path.join(self.tmp, f"zero-{kind}-zero1")
            train_on_ranks(zero1, 4, 2, *flags, *extra, *LORA, *PP2_EP2, steps=STEPS)
            for zero, schedule_name, schedule in (("2", "1f1b", []), ("3", "interleaved", INTERLEAVED)):
                with self.subTest(kind=kind, zero=zero, schedule=schedule_name):
                    run = os.path.join(self.tmp, f"zero-{kind}-zero{zero}-{schedule_name}")
                    result = train_on_ranks(run, 4, 2, *flags, *extra, *LORA, *PP2_EP2[:-1], zero, *schedule,
                                            steps=STEPS)
                    if kind == "lora":
                        self.assertIn(f"(ZeRO-{zero}, 2 shard ranks", result.stdout + result.stderr)
                    self.expect_follows(run, one)
                    for k in ("train", "eval"):
                        self.assertEqual([(r["loss"], r.get("grad_norm")) for r in records(run, k)],
                                         [(r["loss"], r.get("grad_norm")) for r in records(zero1, k)], k)

    def test_hybrid_sharding_follows_one_process(self):
        """PP2 x 2 replicas x 2 shard ranks x EP2 (8 ranks): each replica's stage ranks form
        the expert-parallel groups (NOTE [Expert parallelism under hybrid sharding]); the
        adapters' gradients summed over every rank as on 4."""
        flags = MODELS["mixtral"]
        one = os.path.join(self.tmp, "hsdp-one")
        train_on_ranks(one, 1, 1, *flags, *LORA, steps=STEPS)
        run = os.path.join(self.tmp, "hsdp-pp2-r2-s2-ep2")
        train_on_ranks(run, 8, 4, *flags, *LORA, *PP2_EP2, "--parallelism.data_parallel_replicate_degree", "2",
                       steps=STEPS)
        self.expect_follows(run, one)

    def test_info_sizes_the_frozen_base_by_the_experts(self):
        """forge info: a pipeline rank's frozen ZeRO-1 base holds its stages' units with 8 of
        the 64 routed experts each (and the chunk, 1/8 of its stages either way), so it shrinks
        with expert parallelism 8; the adapters (whole on every rank) do not."""
        base = ["deepseek-v2-lite", "--model.num_layers", "26", "--training.device", "cuda",
                "--training.local_batch_size", "1", "--parallelism.data_parallel_shard_degree", "8",
                "--parallelism.pipeline_parallel_degree", "2", "--parallelism.zero_stage", "1", "--lora.rank", "16",
                "--lora.target_modules", "q_proj,o_proj,gate,experts.gate_up_proj,experts.down_proj"]
        sizes = {}
        for degree in (1, 8):
            result = subprocess.run([forge_bin(), "info", *base, "--parallelism.expert_parallel_degree", str(degree)],
                                    capture_output=True, text=True, timeout=120)
            self.assertEqual(result.returncode, 0, result.stderr)
            line = next(l for l in result.stdout.splitlines() if "one GPU (bf16)" in l)
            sizes[degree] = {name: float(re.search(name + r" ([0-9.]+) GiB", line).group(1))
                             for name in ("frozen bf16 weights", "master weights", "AdamW state")}
        print(f"frozen bf16 weights: {sizes[1]['frozen bf16 weights']} GiB (EP 1), "
              f"{sizes[8]['frozen bf16 weights']} GiB (EP 8)")
        self.assertLess(sizes[8]["frozen bf16 weights"], sizes[1]["frozen bf16 weights"] / 2)
        self.assertEqual(sizes[8]["master weights"], sizes[1]["master weights"])
        self.assertEqual(sizes[8]["AdamW state"], sizes[1]["AdamW state"])

    def test_qlora_follows_one_process_and_resumes(self):
        """QLoRA (NOTE [QLoRA under pipeline and expert parallelism] in src/model/lora.h): each
        rank's NF4 base holds its stages' blocks with its experts' codes alone; the merged export
        is written in pieces with no gather (the stage's two ranks each dequantize, merge and
        write their own experts), and equals one process's merged export within the adapters'
        tolerance. The PP2 x EP2 checkpoint resumes on one process, and one process's under PP2 x
        EP2 with the interleaved schedule."""
        for model in ("mixtral", "deepseek"):
            flags = [*MODELS[model], *QLORA]
            with self.subTest(model=model):
                one = os.path.join(self.tmp, f"qlora-{model}-one")
                train_on_ranks(one, 1, 1, *flags, *LORA, steps=STEPS)
                run = os.path.join(self.tmp, f"qlora-{model}-pp2-ep2")
                result = train_on_ranks(run, 4, 2, *flags, *LORA, *PP2_EP2, steps=STEPS)
                self.assertIn("Hugging Face export was written by every rank", result.stdout + result.stderr)
                self.expect_follows(run, one)
                if model == "mixtral":
                    self.expect_loads_in_transformers(run, one)
                    expect_resumes_under_layouts(
                        self, self.tmp, f"qlora-{model}", [*flags, *LORA],
                        (("resumed on one process", f"qlora-{model}-pp2-ep2", 1, 1, NO_EXPORT, "saved by 1 rank"),
                         ("resumed under pp2 x ep2 interleaved", f"qlora-{model}-one", 4, 2,
                          PP2_EP2 + INTERLEAVED + NO_EXPORT, "saved by 1 rank")),
                        TOLERANCE, steps=STEPS)

    def expect_loads_in_transformers(self, run, one):
        """The merged export written in pieces loads into transformers and computes one
        process's merged model's logits."""
        import torch
        from transformers import AutoModelForCausalLM

        def load(d):
            return AutoModelForCausalLM.from_pretrained(os.path.join(d, "hf"), dtype=torch.float64,
                                                        attn_implementation="eager",
                                                        experts_implementation="eager").eval()

        tokens = torch.arange(1, 17).reshape(1, 16)
        with torch.no_grad():
            mine, theirs = (load(d)(input_ids=tokens).logits.numpy() for d in (run, one))
        gap = relative_error(mine, theirs)
        print(f"{os.path.basename(run)} merged export's logits in transformers: {gap:.2e}")
        self.assertLess(gap, ADAPTER_TOLERANCE)

    def test_qlora_hybrid_sharding_follows_one_process(self):
        """QLoRA under PP2 x 2 replicas x 2 shard ranks x EP2 (8 ranks): the NF4 base replicated
        over each stage's 4 ranks but for the experts; the export written by each stage's first
        expert-parallel group."""
        flags = [*MODELS["mixtral"], *QLORA]
        one = os.path.join(self.tmp, "qlora-mixtral-one")
        if not os.path.exists(os.path.join(one, "hf")):
            train_on_ranks(one, 1, 1, *flags, *LORA, steps=STEPS)
        run = os.path.join(self.tmp, "qlora-hsdp-pp2-r2-s2-ep2")
        train_on_ranks(run, 8, 4, *flags, *LORA, *PP2_EP2, "--parallelism.data_parallel_replicate_degree", "2",
                       steps=STEPS, timeout=600)
        self.expect_follows(run, one)

    def test_info_sizes_the_nf4_base_by_the_experts(self):
        """forge info: a pipeline rank's NF4 base holds its stages' codes with 8 of the 64
        routed experts each under expert parallelism 8; the adapters do not shrink."""
        base = ["deepseek-v2-lite", "--model.num_layers", "26", "--training.device", "cuda",
                "--training.local_batch_size", "1", "--parallelism.data_parallel_shard_degree", "8",
                "--parallelism.pipeline_parallel_degree", "2", "--parallelism.zero_stage", "1", "--lora.rank", "16",
                "--lora.quantize_base", "nf4",
                "--lora.target_modules", "q_proj,o_proj,gate,experts.gate_up_proj,experts.down_proj"]
        sizes = {}
        for degree in (1, 8):
            result = subprocess.run([forge_bin(), "info", *base, "--parallelism.expert_parallel_degree", str(degree)],
                                    capture_output=True, text=True, timeout=120)
            self.assertEqual(result.returncode, 0, result.stderr)
            line = next(l for l in result.stdout.splitlines() if "one GPU (bf16)" in l)
            sizes[degree] = {name: float(re.search(name + r" ([0-9.]+) GiB", line).group(1))
                             for name in ("frozen NF4 projections with their scratch", "master weights",
                                          "AdamW state")}
        print(f"NF4 base: {sizes[1]['frozen NF4 projections with their scratch']} GiB (EP 1), "
              f"{sizes[8]['frozen NF4 projections with their scratch']} GiB (EP 8)")
        self.assertLess(sizes[8]["frozen NF4 projections with their scratch"],
                        sizes[1]["frozen NF4 projections with their scratch"] / 2)
        self.assertEqual(sizes[8]["master weights"], sizes[1]["master weights"])
        self.assertEqual(sizes[8]["AdamW state"], sizes[1]["AdamW state"])

if __name__ == "__main__":
    unittest.main()
