"""Hugging Face import and export of DeepSeek-V2 and DeepSeek-V3 (DeepseekV2ForCausalLM,
DeepseekV3ForCausalLM) against transformers itself: tiny random models saved with
save_pretrained (which writes the published checkpoints' per-expert names,
mlp.experts.E.gate_proj / up_proj / down_proj, the empty shared experts of a model without
them, and V3's routing bias in fp32 beside bf16 weights) are imported by forge, whose logits
must equal transformers' within 1e-4 relative in float32; forge's export of each, in fp32, bf16
and fp16, loads with from_pretrained with no missing or unexpected keys, holds the same
weights (bit for bit where the dtype allows, the routing bias always in fp32) and gives the
same logits; the export of the import is the source bit for bit. Covered: Multi-head Latent
Attention with and without a compressed query, YaRN, shared experts and dense first blocks,
V2's greedy softmax routing and V3's group-limited sigmoid routing, V3's rope_interleave
false, tied embeddings, sharded files, bf16 weights, and transformers 5's in-memory names
(save_original_format=False). config.json settings forge does not build and damaged weights
are refused naming the file and the key or tensor; a training run starts from a DeepSeek
directory alone, exports it bit for bit with a zero learning rate, and its trained export
loads in transformers; forge eval and hf-info read the directory."""
import json
import os
import subprocess
import unittest

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from forge_test_util import forge_bin, records, relative_error, run, scratch_dir, tool
from hf_tiny import deepseek_published_names, random_model

TOLERANCE = 1e-4
BATCH, SEQ = 2, 13
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.707, "mscale_all_dim": 0.707}


def deepseek_v2(**overrides):
    """DeepSeek-V2-Lite's shape, tiny: uncompressed queries, one dense block, 2 shared experts,
    greedy top-2 of 6 softmax scores, not renormalized."""
    config = dict(vocab_size=53, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, n_routed_experts=6, num_experts_per_tok=2,
                  n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
                  qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=64, topk_method="greedy", n_group=1,
                  topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config.update(overrides)
    return config


def deepseek_v3(**overrides):
    """DeepSeek-V3's shape, tiny: a compressed query, one dense block, one shared expert,
    top-3 of 8 sigmoid scores plus the routing bias in the best 2 of 4 groups, renormalized, x 2.5."""
    config = deepseek_v2(q_lora_rank=12, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=4,
                         topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    del config["topk_method"]
    config.update(overrides)
    return config


CASES = [
    dict(name="v2_yarn", family="deepseek_v2", config=deepseek_v2(rope_parameters=YARN)),
    dict(name="v2_no_shared_experts_compressed_query_sharded", family="deepseek_v2", max_shard_size="20KB",
         config=deepseek_v2(n_shared_experts=0, q_lora_rank=12, first_k_dense_replace=0, num_experts_per_tok=1)),
    # DeepSeek-V2 236B's routing: group_limited_greedy (the best 2 of 3 groups) scaled by 16.
    dict(name="v2_group_limited_scaled", family="deepseek_v2",
         config=deepseek_v2(topk_method="group_limited_greedy", n_group=3, topk_group=2,
                            routed_scaling_factor=16.0)),
    dict(name="v3_yarn_mscale_all_dim", family="deepseek_v3",
         config=deepseek_v3(rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=0.8))),
    dict(name="v3_bf16_tied_rope_not_interleaved", family="deepseek_v3", save_dtype=torch.bfloat16,
         config=deepseek_v3(rope_interleave=False, tie_word_embeddings=True, n_shared_experts=0,
                            first_k_dense_replace=2, routed_scaling_factor=1.5, norm_topk_prob=False)),
]

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
BIAS = "e_score_correction_bias"


def save_model(family, config, directory, seed, save_dtype=None, **kwargs):
    """A random model saved as transformers saves it; in bf16 as one loaded with
    from_pretrained(dtype=bfloat16) is saved: the routing bias stays fp32
    (_keep_in_fp32_modules_strict)."""
    model = random_model(family, config, seed)
    model.save_pretrained(directory, **kwargs)
    if save_dtype is not None:
        AutoModelForCausalLM.from_pretrained(directory, dtype=save_dtype).save_pretrained(directory, **kwargs)
    return model


def transformers_logits(model_dir, tokens):
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                       experts_implementation="eager", output_loading_info=True)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(tokens).long()).logits
    return logits.reshape(-1, model.config.vocab_size).numpy(), model, info


def forge_logits(model_dir, tokens, work):
    tokens_path, out = os.path.join(work, "tokens.bin"), os.path.join(work, "logits.bin")
    tokens.astype(np.int32).tofile(tokens_path)
    run([tool("forge_hf_logits"), "logits", model_dir, tokens_path, str(tokens.shape[0]), str(tokens.shape[1]), out])
    return np.fromfile(out, dtype=np.float32).reshape(tokens.shape[0] * tokens.shape[1], -1)


def stored_tensors(model_dir):
    """Every tensor of a directory's safetensors files (one file or shards), by name."""
    tensors = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(model_dir, name)))
    return tensors


def read_config(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


ARCHITECTURE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "n_routed_experts", "num_experts_per_tok",
                     "n_shared_experts", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group", "norm_topk_prob",
                     "routed_scaling_factor", "tie_word_embeddings", "max_position_embeddings")


class ImportExport(unittest.TestCase):
    def expect_same_architecture(self, config, source_config, family):
        for key in ARCHITECTURE_KEYS:
            self.assertEqual(config[key], source_config[key], key)
        rope, source_rope = config["rope_parameters"], source_config["rope_parameters"]
        for key in source_rope:
            self.assertEqual(rope[key], source_rope[key], f"rope_parameters.{key}")
        if family == "deepseek_v3":
            self.assertEqual(config["rope_interleave"], source_config["rope_interleave"])

    def check_case(self, case):
        work = scratch_dir()
        source = os.path.join(work, "hf")
        family = case["family"]
        save_model(family, case["config"], source, seed=len(case["name"]), save_dtype=case.get("save_dtype"),
                   max_shard_size=case.get("max_shard_size", "5GB"))
        if "max_shard_size" in case:
            self.assertTrue(os.path.exists(os.path.join(source, "model.safetensors.index.json")))
        saved = stored_tensors(source)
        # transformers 5 writes the published per-expert names, not its in-memory stacks.
        self.assertIn("model.layers.2.mlp.experts.0.gate_proj.weight", saved)
        self.assertFalse([n for n in saved if n.endswith("gate_up_proj")])
        if case["config"]["n_shared_experts"] == 0:  # and the shared experts it builds anyway, empty
            self.assertEqual(list(saved["model.layers.2.mlp.shared_experts.down_proj.weight"].shape), [32, 0])
        if family == "deepseek_v3":
            self.assertEqual(saved[f"model.layers.2.mlp.gate.{BIAS}"].dtype, torch.float32)

        tokens = np.random.RandomState(7).randint(0, case["config"]["vocab_size"], size=(BATCH, SEQ))
        expected, reference, _ = transformers_logits(source, tokens)
        err = relative_error(forge_logits(source, tokens, work).astype(np.float64), expected.astype(np.float64))
        print(f"{case['name']}: import logits rel err {err:.2e}")
        self.assertLess(err, TOLERANCE, "imported logits")

        source_config = read_config(source)
        source_dtype = case.get("save_dtype", torch.float32)
        for dtype, torch_dtype in DTYPES.items():
            exported = os.path.join(work, f"export-{dtype}")
            run([tool("forge_hf_logits"), "export", source, exported, dtype, "30000"])
            config = read_config(exported)
            self.assertEqual(config["architectures"], source_config["architectures"])
            self.assertEqual(config["model_type"], family)
            self.assertEqual(config["dtype"], str(torch_dtype).removeprefix("torch."))
            self.expect_same_architecture(config, source_config, family)
            # What transformers loads: the names it saved, every one of them, nothing else;
            # the routing bias in fp32.
            written = stored_tensors(exported)
            self.assertEqual(sorted(written), sorted(saved))
            for name, t in written.items():
                self.assertEqual(t.dtype, torch.float32 if name.endswith(BIAS) else torch_dtype, name)
            again, loaded, info = transformers_logits(exported, tokens)
            self.assertEqual(type(loaded).__name__, source_config["architectures"][0])
            self.assertEqual({k: v for k, v in info.items() if v}, {}, "loading info")
            as_stored = AutoModelForCausalLM.from_pretrained(exported, dtype="auto")
            self.assertEqual({p.dtype for p in as_stored.parameters()}, {torch_dtype})
            state = loaded.state_dict()
            for name, p in reference.state_dict().items():
                want = p.float() if name.endswith(BIAS) else p.float().to(torch_dtype).float()
                self.assertTrue(torch.equal(state[name].float(), want), f"{dtype} export of {name}")
            # Bit for bit where the dtype holds the source's values: the export of the import is
            # the source.
            for name, t in saved.items():
                want = t if torch_dtype == source_dtype or name.endswith(BIAS) else t.float().to(torch_dtype)
                self.assertTrue(torch.equal(written[name], want), f"{dtype} export of {name}")
                self.assertEqual(written[name].dtype, want.dtype, name)
            if dtype == "f32":
                err = relative_error(again.astype(np.float64), expected.astype(np.float64))
                print(f"{case['name']}: logits of forge's export rel err {err:.2e}")
                self.assertLess(err, TOLERANCE, "exported logits")

    def test_cases(self):
        for case in CASES:
            with self.subTest(case["name"]):
                self.check_case(case)

    def test_transformers_5_in_memory_names(self):
        # save_pretrained(save_original_format=False) writes the experts as transformers 5 holds
        # them (mlp.experts.gate_up_proj, mlp.experts.down_proj): forge reads them too, and
        # exports the published names.
        work = scratch_dir()
        source = os.path.join(work, "hf")
        save_model("deepseek_v3", deepseek_v3(), source, seed=5, save_original_format=False)
        saved = stored_tensors(source)
        self.assertIn("model.layers.1.mlp.experts.gate_up_proj", saved)
        tokens = np.random.RandomState(3).randint(0, 53, size=(BATCH, SEQ))
        expected, _, _ = transformers_logits(source, tokens)
        err = relative_error(forge_logits(source, tokens, work).astype(np.float64), expected.astype(np.float64))
        print(f"in-memory names: import logits rel err {err:.2e}")
        self.assertLess(err, TOLERANCE)
        exported = os.path.join(work, "export")
        run([tool("forge_hf_logits"), "export", source, exported, "f32"])
        written = stored_tensors(exported)
        published = deepseek_published_names(saved)
        self.assertEqual(sorted(written), sorted(published))
        for name, t in published.items():
            self.assertTrue(torch.equal(written[name], t), name)


class DamagedCheckpoints(unittest.TestCase):
    """A bad DeepSeek directory is refused naming the file and the tensor or key."""

    def setUp(self):
        self.work = scratch_dir()
        self.source = os.path.join(self.work, "hf")
        save_model("deepseek_v3", deepseek_v3(), self.source, seed=9)
        self.weights = os.path.join(self.source, "model.safetensors")
        self.config = os.path.join(self.source, "config.json")

    def refusal(self):
        tokens = os.path.join(self.work, "tokens.bin")
        np.zeros((1, 4), dtype=np.int32).tofile(tokens)
        result = subprocess.run([tool("forge_hf_logits"), "logits", self.source, tokens, "1", "4",
                                 os.path.join(self.work, "logits.bin")], capture_output=True, text=True)
        self.assertEqual(result.returncode, 1, result.stderr)
        return result.stderr

    def edit_tensors(self, edit):
        tensors = load_file(self.weights)
        edit(tensors)
        save_file(tensors, self.weights, metadata={"format": "pt"})

    def edit_config(self, edit):
        with open(self.config) as f:
            config = json.load(f)
        edit(config)
        with open(self.config, "w") as f:
            json.dump(config, f)

    def test_config_settings_forge_does_not_build(self):
        refusals = [
            (dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", topk_method="group_limited_greedy",
                  n_group=None, norm_topk_prob=False, routed_scaling_factor=1.0),
             "\"n_group\" is missing or null with topk_method \"group_limited_greedy\": expected a positive integer"),
            (dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", n_group=1, topk_group=1,
                  norm_topk_prob=True, routed_scaling_factor=1.0),
             "\"norm_topk_prob\" is true; DeepseekV2ForCausalLM never renormalizes the top-k weights"),
            (dict(num_key_value_heads=2), "\"num_key_value_heads\" is 2; Multi-head Latent Attention gives each of the "
                                          "4 heads (\"num_attention_heads\") keys and values of its own: expected 4"),
            (dict(moe_layer_freq=2), "\"moe_layer_freq\" is 2;"),
            (dict(scoring_func="softmax"), "\"scoring_func\" is 'softmax'; DeepseekV3ForCausalLM routes on sigmoid"),
            (dict(rope_parameters=dict(YARN, attention_factor=2.0)), "\"rope_parameters.attention_factor\" is 2"),
            (dict(quantization_config={"quant_method": "fp8"}), "\"quantization_config\" is set"),
        ]
        for edit, message in refusals:
            with self.subTest(message):
                with open(self.config) as f:
                    original = f.read()
                self.edit_config(lambda c: c.update(edit))
                self.assertIn(f"{self.config}: {message}", self.refusal())
                with open(self.config, "w") as f:
                    f.write(original)

    def test_misshapen_kv_projection(self):
        name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
        self.edit_tensors(lambda t: t.update({name: torch.zeros(22, 32)}))
        self.assertIn(f"{self.weights}: tensor '{name}' has shape [22, 32], but the model's architecture needs "
                      "[20, 32]", self.refusal())

    def test_missing_routing_bias(self):
        name = f"model.layers.1.mlp.gate.{BIAS}"
        self.edit_tensors(lambda t: t.pop(name))
        self.assertIn(f"{self.source}: no tensor '{name}' in the weight files (expected [8] for forge's "
                      "'layers.1.moe.router.bias')", self.refusal())

    def test_truncated_file(self):
        with open(self.weights, "r+b") as f:
            f.truncate(os.path.getsize(self.weights) - 100)
        self.assertIn(self.weights, self.refusal())


class TrainFromDeepseek(unittest.TestCase):
    """forge train from a Hugging Face DeepSeek-V3 directory alone, exporting at the end."""

    def setUp(self):
        self.work = scratch_dir()
        self.source = os.path.join(self.work, "TinyDeepSeek")
        self.model = save_model("deepseek_v3", deepseek_v3(vocab_size=32, rope_parameters=YARN), self.source, seed=4,
                                save_dtype=torch.bfloat16)

    def train(self, run_dir, *extra):
        return run([forge_bin(), "train", "--checkpoint.initial_load_path", self.source,
                    "--checkpoint.last_save_in_hf", "true", "--training.steps", "3",
                    "--training.local_batch_size", "2", "--training.seq_len", "16", "--eval.interval", "0",
                    "--logging.run_dir", run_dir, *extra])

    def test_a_dry_run_exports_the_source_bit_for_bit(self):
        run_dir = os.path.join(self.work, "still")
        self.train(run_dir, "--optimizer.lr", "0", "--lr_scheduler.decay_style", "linear")
        source, exported = stored_tensors(self.source), stored_tensors(os.path.join(run_dir, "hf"))
        self.assertEqual(sorted(source), sorted(exported))
        for name in source:
            self.assertTrue(torch.equal(source[name], exported[name]), name)
            self.assertEqual(source[name].dtype, exported[name].dtype, name)  # bf16, the bias fp32
        before, after = read_config(self.source), read_config(os.path.join(run_dir, "hf"))
        for key in ARCHITECTURE_KEYS + ("architectures", "rope_interleave", "bos_token_id", "eos_token_id", "dtype"):
            self.assertEqual(after[key], before[key], key)
        # The same RoPE; forge also writes YaRN's beta_fast and beta_slow (32 and 1).
        self.assertEqual(after["rope_parameters"], dict(before["rope_parameters"], beta_fast=32.0, beta_slow=1.0))

    def test_trained_export_loads_in_transformers(self):
        run_dir = os.path.join(self.work, "trained")
        self.train(run_dir)
        self.assertEqual(len(records(run_dir, "train")), 3)
        hf_dir = os.path.join(run_dir, "hf")
        tokens = np.random.RandomState(1).randint(0, 32, size=(BATCH, SEQ))
        expected, loaded, info = transformers_logits(hf_dir, tokens)
        self.assertEqual(type(loaded).__name__, "DeepseekV3ForCausalLM")
        self.assertEqual({k: v for k, v in info.items() if v}, {}, "loading info")
        err = relative_error(forge_logits(hf_dir, tokens, self.work).astype(np.float64), expected.astype(np.float64))
        self.assertLess(err, TOLERANCE)
        before = AutoModelForCausalLM.from_pretrained(self.source, dtype=torch.float32).state_dict()
        changed = {n for n, p in loaded.state_dict().items() if not torch.equal(p, before[n])}
        for part in (".mlp.experts.", ".self_attn.kv_a_proj_with_mqa.", ".self_attn.q_b_proj.", ".mlp.gate.weight"):
            self.assertTrue(any(part in n for n in changed), part)
        self.assertFalse([n for n in changed if n.endswith(BIAS)])  # no gradient, no weight decay

    def test_eval_and_hf_info_read_the_directory(self):
        result = run([forge_bin(), "eval", "--model", self.source, "--batches", "1", "--training.seq_len", "16"],
                     cwd=self.work)
        # forge counts the routing biases (buffers in transformers) as parameters.
        total = sum(p.numel() for p in self.model.parameters()) + sum(
            b.numel() for n, b in self.model.named_buffers() if n.endswith(BIAS))
        self.assertIn(f"({total} parameters)", result.stdout + result.stderr)
        out = run([forge_bin(), "hf-info", self.source]).stdout
        self.assertIn("Multi-head Latent Attention (q rank 12, kv rank 16", out)
        self.assertIn("8 experts of ffn 12, top-3 (sigmoid scores, best 2 of 4 groups, renormalized, x 2.5) + 1 shared",
                      out)
        self.assertIn("kv_lora_rank: 16", out)
        self.assertIn("type: yarn", out)

    def test_a_model_no_class_computes_is_refused_before_training(self):
        run_dir = os.path.join(self.work, "shared-without-mla")
        result = subprocess.run([forge_bin(), "train", "--model.name", "debug-tiny-moe", "--model.num_shared_experts",
                                 "1", "--checkpoint.last_save_in_hf", "true", "--training.steps", "3",
                                 "--logging.run_dir", run_dir], capture_output=True, text=True)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("cannot write the model as Hugging Face: model.num_shared_experts is 1", result.stderr)
        self.assertFalse(os.path.exists(os.path.join(run_dir, "metrics.jsonl")))


if __name__ == "__main__":
    unittest.main()
