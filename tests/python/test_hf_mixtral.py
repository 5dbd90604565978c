"""Hugging Face import and export of Mixtral (MixtralForCausalLM) against transformers itself:
random tiny Mixtrals saved with save_pretrained (which writes the published checkpoints'
per-expert names: block_sparse_moe.gate, experts.E.w1 / w3 / w2) are imported by forge,
whose logits must equal transformers' within 1e-4 relative in float32; forge's export of
each, in fp32, bf16 and fp16, loads with from_pretrained, holds the same weights (bit for
bit where the dtype allows) and gives the same logits. Covered: top-1 and top-2, a sliding
window, tied embeddings with Llama 3.1 RoPE, sharded files, bf16 weights, the balancing
loss's keys, and transformers 5's in-memory names (save_original_format=False). Damaged
checkpoints are refused naming the file and the tensor or key; a training run starts from a
Mixtral directory alone, exports it bit for bit with a zero learning rate, and its trained
export loads in transformers; forge eval and hf-info read the experts from the directory."""
import json
import os
import subprocess
import unittest

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from forge_test_util import forge_bin, records, relative_error, run, scratch_dir, tool
from hf_tiny import published_names, random_model

TOLERANCE = 1e-4
BATCH, SEQ = 2, 13
ROPE = {"rope_type": "default", "rope_theta": 1e6}


def mixtral(**overrides):
    config = dict(vocab_size=53, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                  sliding_window=None, rope_parameters=ROPE)
    config.update(overrides)
    return config


CASES = [
    dict(name="top2", config=mixtral()),
    dict(name="top1_sliding_window_sharded", max_shard_size="20KB",
         config=mixtral(num_local_experts=3, num_experts_per_tok=1, sliding_window=5)),
    dict(name="tied_llama3_rope_8_experts",
         config=mixtral(vocab_size=37, hidden_size=24, num_attention_heads=3, num_key_value_heads=1, head_dim=10,
                        intermediate_size=16, num_local_experts=8, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8})),
    dict(name="balancing_loss_saved_in_bf16", save_dtype=torch.bfloat16,
         config=mixtral(output_router_logits=True, router_aux_loss_coef=0.02)),
]

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def transformers_logits(model_dir, tokens):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens).long()).logits.reshape(-1, model.config.vocab_size).numpy(), model


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


class ImportExport(unittest.TestCase):
    def check_case(self, case):
        work = scratch_dir()
        source = os.path.join(work, "hf")
        model = random_model("mixtral", case["config"], seed=len(case["name"]))
        if "save_dtype" in case:
            model = model.to(case["save_dtype"])
        model.save_pretrained(source, max_shard_size=case.get("max_shard_size", "5GB"))
        if "max_shard_size" in case:
            self.assertTrue(os.path.exists(os.path.join(source, "model.safetensors.index.json")))
        saved = stored_tensors(source)
        # transformers 5 writes the published names, not its in-memory stacks.
        self.assertIn("model.layers.0.block_sparse_moe.experts.0.w1.weight", saved)
        self.assertFalse([n for n in saved if ".mlp." in n])

        tokens = np.random.RandomState(7).randint(0, case["config"]["vocab_size"], size=(BATCH, SEQ))
        expected, reference = transformers_logits(source, tokens)
        mine = forge_logits(source, tokens, work)
        err = relative_error(mine.astype(np.float64), expected.astype(np.float64))
        print(f"{case['name']}: import logits rel err {err:.2e}")
        self.assertLess(err, TOLERANCE, "imported logits")

        with open(os.path.join(source, "config.json")) as f:
            source_config = json.load(f)
        reference_state = published_names(reference.state_dict())
        for dtype, torch_dtype in DTYPES.items():
            exported = os.path.join(work, f"export-{dtype}")
            run([tool("forge_hf_logits"), "export", source, exported, dtype, "30000"])
            with open(os.path.join(exported, "config.json")) as f:
                config = json.load(f)
            self.assertEqual(config["architectures"], ["MixtralForCausalLM"])
            self.assertEqual(config["model_type"], "mixtral")
            self.assertEqual(config["dtype"], str(torch_dtype).removeprefix("torch."))
            for key in ("num_local_experts", "num_experts_per_tok", "sliding_window", "output_router_logits",
                        "router_aux_loss_coef", "tie_word_embeddings"):
                self.assertEqual(config[key], source_config[key], key)
            # What transformers loads: the published names, every one of them, nothing else.
            written = stored_tensors(exported)
            self.assertEqual(sorted(written), sorted(saved))
            again, loaded = transformers_logits(exported, tokens)
            self.assertEqual(type(loaded).__name__, "MixtralForCausalLM")
            as_stored = AutoModelForCausalLM.from_pretrained(exported, dtype="auto")
            self.assertEqual({p.dtype for p in as_stored.parameters()}, {torch_dtype})
            state = loaded.state_dict()
            for name, p in reference.state_dict().items():
                want = p.float().to(torch_dtype).float()
                self.assertTrue(torch.equal(state[name].float(), want), f"{dtype} export of {name}")
            # Bit for bit where the dtype holds the source's values exactly.
            if torch_dtype == case.get("save_dtype", torch.float32):
                for name, t in saved.items():
                    self.assertTrue(torch.equal(written[name], t), f"{dtype} export of {name}")
            else:
                for name, t in saved.items():
                    self.assertTrue(torch.equal(written[name], t.float().to(torch_dtype)), f"{dtype} export of {name}")
            if dtype == "f32":
                # The names hf_tiny's published_names gives transformers' in-memory stacks
                # (test_model_vs_torch.py relies on them) are the ones written.
                tied = {"lm_head.weight"} if config["tie_word_embeddings"] else set()
                self.assertEqual(sorted(written), sorted(set(reference_state) - tied))
                for name in written:
                    self.assertTrue(torch.equal(written[name], reference_state[name].float()), name)
                err = relative_error(again.astype(np.float64), expected.astype(np.float64))
                print(f"{case['name']}: logits of forge's export rel err {err:.2e}")
                self.assertLess(err, TOLERANCE, "exported logits")

    def test_cases(self):
        for case in CASES:
            with self.subTest(case["name"]):
                self.check_case(case)

    def test_transformers_5_in_memory_names(self):
        # save_pretrained(save_original_format=False) writes the stacks as transformers 5 holds
        # them (mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj): forge reads
        # them too, and exports the published names.
        work = scratch_dir()
        source = os.path.join(work, "hf")
        model = random_model("mixtral", mixtral(), seed=5)
        model.save_pretrained(source, save_original_format=False)
        saved = stored_tensors(source)
        self.assertIn("model.layers.1.mlp.experts.gate_up_proj", saved)
        tokens = np.random.RandomState(3).randint(0, 53, size=(BATCH, SEQ))
        expected, _ = transformers_logits(source, tokens)
        err = relative_error(forge_logits(source, tokens, work).astype(np.float64), expected.astype(np.float64))
        print(f"in-memory names: import logits rel err {err:.2e}")
        self.assertLess(err, TOLERANCE)
        exported = os.path.join(work, "export")
        run([tool("forge_hf_logits"), "export", source, exported, "f32"])
        written = stored_tensors(exported)
        published = published_names(saved)
        self.assertEqual(sorted(written), sorted(published))
        for name, t in published.items():
            self.assertTrue(torch.equal(written[name], t), name)


class DamagedCheckpoints(unittest.TestCase):
    """A bad Mixtral directory is refused naming the file and the tensor or key."""

    def setUp(self):
        self.work = scratch_dir()
        self.source = os.path.join(self.work, "hf")
        random_model("mixtral", mixtral(num_local_experts=3), seed=9).save_pretrained(self.source)
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

    def test_missing_expert_tensor(self):
        name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
        self.edit_tensors(lambda t: t.pop(name))
        e = self.refusal()
        self.assertIn(f"{self.source}: no tensor '{name}' in the weight files (expected [32, 24] for forge's "
                      "'layers.1.moe.experts.down'", e)

    def test_wrong_expert_shape(self):
        name = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
        self.edit_tensors(lambda t: t.update({name: torch.zeros(20, 32)}))
        self.assertIn(f"{self.weights}: tensor '{name}' has shape [20, 32], but the model's architecture needs "
                      "[24, 32]", self.refusal())

    def test_num_local_experts_disagreeing_with_the_tensors(self):
        self.edit_config(lambda c: c.update(num_local_experts=4))
        self.assertIn(f"{self.weights}: tensor 'model.layers.0.block_sparse_moe.gate.weight' has shape [3, 32], but "
                      "the model's architecture needs [4, 32]", self.refusal())
        self.edit_config(lambda c: c.update(num_local_experts=3))
        extra = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
        self.edit_tensors(lambda t: t.update({extra: torch.zeros(24, 32)}))
        self.assertIn(f"1 tensor(s) that a Mixtral model does not have: {extra} (config.json's num_local_experts "
                      "is 3: experts 0 to 2)", self.refusal())

    def test_unknown_architecture_and_router_jitter(self):
        self.edit_config(lambda c: c.update(architectures=["Qwen2MoeForCausalLM"]))
        self.assertIn(f"{self.config}: \"architectures\" is [\"Qwen2MoeForCausalLM\"]; forge imports "
                      "LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, DeepseekV2ForCausalLM and "
                      "DeepseekV3ForCausalLM", self.refusal())
        self.edit_config(lambda c: c.update(architectures=["MixtralForCausalLM"], router_jitter_noise=0.01))
        self.assertIn(f"{self.config}: \"router_jitter_noise\" is 0.01; forge's router has no jitter",
                      self.refusal())



class TrainFromMixtral(unittest.TestCase):
    """forge train from a Hugging Face Mixtral directory alone, exporting at the end."""

    def setUp(self):
        self.work = scratch_dir()
        self.source = os.path.join(self.work, "TinyMixtral")
        # The published Mixtral's balancing keys: 0.02, dormant (output_router_logits false).
        self.model = random_model("mixtral", mixtral(vocab_size=32, router_aux_loss_coef=0.02), seed=4)
        self.model.save_pretrained(self.source)

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
        with open(os.path.join(self.source, "config.json")) as f:
            before = json.load(f)
        with open(os.path.join(run_dir, "hf", "config.json")) as f:
            after = json.load(f)
        for key in ("architectures", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef",
                    "output_router_logits", "sliding_window", "bos_token_id", "eos_token_id"):
            self.assertEqual(after[key], before[key], key)

    def test_trained_export_loads_in_transformers(self):
        run_dir = os.path.join(self.work, "trained")
        self.train(run_dir, "--model.router_aux_loss_coef", "0.05")
        self.assertEqual(len(records(run_dir, "train")), 3)
        hf_dir = os.path.join(run_dir, "hf")
        with open(os.path.join(hf_dir, "config.json")) as f:
            config = json.load(f)
        self.assertEqual((config["router_aux_loss_coef"], config["output_router_logits"]), (0.05, True))
        tokens = np.random.RandomState(1).randint(0, 32, size=(BATCH, SEQ))
        expected, loaded = transformers_logits(hf_dir, tokens)
        self.assertEqual(type(loaded).__name__, "MixtralForCausalLM")
        err = relative_error(forge_logits(hf_dir, tokens, self.work).astype(np.float64), expected.astype(np.float64))
        self.assertLess(err, TOLERANCE)
        changed = [n for n, p in loaded.state_dict().items() if not torch.equal(p, self.model.state_dict()[n])]
        self.assertTrue(any(".experts." in n for n in changed), changed)

    def test_eval_reads_the_experts_from_the_directory(self):
        result = run([forge_bin(), "eval", "--model", self.source, "--batches", "1", "--training.seq_len", "16"],
                     cwd=self.work)
        total = sum(p.numel() for p in self.model.parameters())
        self.assertIn(f"({total} parameters)", result.stdout + result.stderr)

    def test_hf_info_names_the_experts(self):
        out = run([forge_bin(), "hf-info", self.source]).stdout
        self.assertIn("4 experts of ffn 24, top-2 (softmax scores, renormalized)", out)
        self.assertIn("num_experts: 4", out)
        self.assertIn("router_aux_loss_coef: 0", out)


if __name__ == "__main__":
    unittest.main()
