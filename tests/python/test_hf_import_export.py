"""Hugging Face import and export against transformers itself: random tiny Llama and
Mistral models saved with save_pretrained (one file, sharded, bf16, tied embeddings with
Llama 3.1 RoPE scaling, a sliding window) are imported by forge, whose logits must equal
transformers' within 1e-4 relative; forge's export of each loads with from_pretrained and
gives the same logits again, in fp32, bf16 and fp16. Training runs that start from a
Hugging Face directory with checkpoint.initial_load_path alone (architecture and name from
the folder, first loss equal to transformers', export in the source's class and the asked
dtype), conflicts, hf-info's YAML and a zero learning rate are checked end to end."""
import json
import os
import subprocess
import unittest

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_tiny import DEBUG_TINY, random_model
from forge_test_util import forge_bin, records, relative_error, run, scratch_dir, tool

TOLERANCE = 1e-4
BATCH, SEQ = 2, 13


CASES = [
    dict(name="llama_gqa", family="llama",
         config=dict(vocab_size=61, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=6,
                     num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    dict(name="llama_sharded", family="llama", max_shard_size="20KB",
         config=dict(vocab_size=50, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
    dict(name="llama_tied_llama3_rope", family="llama",
         config=dict(vocab_size=37, hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=1, head_dim=12, tie_word_embeddings=True, max_position_embeddings=64,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8})),
    dict(name="mistral_sliding_window", family="mistral",
         config=dict(vocab_size=45, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, sliding_window=4,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    dict(name="mistral_without_window", family="mistral",
         config=dict(vocab_size=45, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, sliding_window=None,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    dict(name="llama_saved_in_bf16", family="llama", save_dtype=torch.bfloat16,
         config=dict(vocab_size=40, hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
]


def transformers_logits(model_dir, tokens):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens).long()).logits.reshape(-1, model.config.vocab_size).numpy(), model


def forge_logits(model_dir, tokens, work):
    tokens_path, out = os.path.join(work, "tokens.bin"), os.path.join(work, "logits.bin")
    tokens.astype(np.int32).tofile(tokens_path)
    run([tool("forge_hf_logits"), "logits", model_dir, tokens_path, str(tokens.shape[0]), str(tokens.shape[1]), out])
    return np.fromfile(out, dtype=np.float32).reshape(tokens.shape[0] * tokens.shape[1], -1)


class ImportExport(unittest.TestCase):
    def check_case(self, case):
        work = scratch_dir()
        source = os.path.join(work, "hf")
        model = random_model(case["family"], case["config"], seed=len(case["name"]))
        if "save_dtype" in case:
            model = model.to(case["save_dtype"])
        model.save_pretrained(source, max_shard_size=case.get("max_shard_size", "5GB"))
        with open(os.path.join(source, "tokenizer.json"), "w") as f:
            f.write('{"placeholder": "copied with the export"}')
        if "max_shard_size" in case:
            self.assertTrue(os.path.exists(os.path.join(source, "model.safetensors.index.json")))

        tokens = np.random.RandomState(7).randint(0, case["config"]["vocab_size"], size=(BATCH, SEQ))
        expected, reference = transformers_logits(source, tokens)
        mine = forge_logits(source, tokens, work)
        err = relative_error(mine.astype(np.float64), expected.astype(np.float64))
        print(f"{case['name']}: import logits rel err {err:.2e}")
        self.assertLess(err, TOLERANCE, "imported logits")

        for dtype in ("f32", "bf16", "f16"):
            exported = os.path.join(work, f"export-{dtype}")
            run([tool("forge_hf_logits"), "export", source, exported, dtype, "30000"])
            self.assertTrue(os.path.exists(os.path.join(exported, "tokenizer.json")))
            with open(os.path.join(exported, "config.json")) as f:
                config = json.load(f)
            arch = "MistralForCausalLM" if case["family"] == "mistral" else "LlamaForCausalLM"
            torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]
            self.assertEqual(config["architectures"], [arch])
            self.assertEqual(config["dtype"], str(torch_dtype).removeprefix("torch."))
            if case["family"] == "mistral":
                self.assertEqual(config["sliding_window"], case["config"]["sliding_window"])
            again, loaded = transformers_logits(exported, tokens)
            self.assertEqual(type(loaded).__name__, arch)
            as_stored = AutoModelForCausalLM.from_pretrained(exported, dtype="auto")
            self.assertEqual({p.dtype for p in as_stored.parameters()}, {torch_dtype})
            state = {k: v for k, v in loaded.state_dict().items()}
            for name, p in reference.state_dict().items():
                want = p.float().to(torch_dtype).float()
                self.assertTrue(torch.equal(state[name].float(), want), f"{dtype} export of {name}")
            if dtype == "f32":
                err = relative_error(again.astype(np.float64), expected.astype(np.float64))
                print(f"{case['name']}: logits of forge's export rel err {err:.2e}")
                self.assertLess(err, TOLERANCE, "exported logits")

    def test_cases(self):
        for case in CASES:
            with self.subTest(case["name"]):
                self.check_case(case)



class TrainFromHuggingFace(unittest.TestCase):
    """forge train starting from a Hugging Face debug-tiny-shaped Llama, exporting at the end."""

    def setUp(self):
        self.work = scratch_dir()
        self.source = os.path.join(self.work, "hf")
        self.model = random_model("llama", DEBUG_TINY, seed=3)
        self.model.save_pretrained(self.source)

    def train(self, run_dir, *extra):
        return run([forge_bin(), "train", "--checkpoint.initial_load_path", self.source,
                    "--checkpoint.last_save_in_hf", "true", "--training.steps", "3",
                    "--training.local_batch_size", "2", "--training.seq_len", "32", "--eval.interval", "0",
                    "--logging.run_dir", run_dir, *extra])

    def test_starts_from_the_hf_weights_and_exports_them(self):
        # A zero learning rate is a dry run: the export must be the source, bit for bit, which
        # checks that training started from the Hugging Face weights and exported them.
        run_dir = os.path.join(self.work, "still")
        self.train(run_dir, "--optimizer.lr", "0", "--lr_scheduler.decay_style", "linear")
        self.assertEqual({r["lr"] for r in records(run_dir, "train")}, {0.0})
        source = load_file(os.path.join(self.source, "model.safetensors"))
        exported = load_file(os.path.join(run_dir, "hf", "model.safetensors"))
        self.assertEqual(sorted(source), sorted(exported))
        for name in source:
            self.assertTrue(torch.equal(source[name], exported[name]), name)

    def test_trained_export_loads_in_transformers(self):
        run_dir = os.path.join(self.work, "trained")
        self.train(run_dir, "--checkpoint.initial_load_in_hf", "true")  # the explicit key still works
        losses = [r["loss"] for r in records(run_dir, "train")]
        self.assertEqual(len(losses), 3)
        hf_dir = os.path.join(run_dir, "hf")
        tokens = np.random.RandomState(1).randint(0, 32, size=(BATCH, SEQ))
        expected, loaded = transformers_logits(hf_dir, tokens)
        self.assertEqual(type(loaded).__name__, "LlamaForCausalLM")
        err = relative_error(forge_logits(hf_dir, tokens, self.work).astype(np.float64), expected.astype(np.float64))
        self.assertLess(err, TOLERANCE)
        changed = [n for n, p in loaded.state_dict().items() if not torch.equal(p, self.model.state_dict()[n])]
        self.assertTrue(changed, "training did not change the weights")

    def test_export_max_shard_size_cuts_the_files_as_save_pretrained(self):
        # checkpoint.export_max_shard_size as save_pretrained's max_shard_size: a lr-0 export
        # cut into several files with an index equals the source, and transformers loads it.
        run_dir = os.path.join(self.work, "sharded")
        self.train(run_dir, "--optimizer.lr", "0", "--lr_scheduler.decay_style", "linear",
                   "--checkpoint.export_max_shard_size", "20KB")
        hf_dir = os.path.join(run_dir, "hf")
        with open(os.path.join(hf_dir, "model.safetensors.index.json")) as f:
            index = json.load(f)["weight_map"]
        files = sorted(set(index.values()))
        self.assertGreater(len(files), 2)
        for name in files:  # a file holds more than one tensor only while under 20 kB
            tensors = load_file(os.path.join(hf_dir, name))
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            self.assertTrue(len(tensors) == 1 or size <= 20_000, f"{name}: {len(tensors)} tensors, {size} bytes")
        source = load_file(os.path.join(self.source, "model.safetensors"))
        self.assertEqual(sorted(source), sorted(index))
        loaded = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        for name, p in self.model.state_dict().items():
            self.assertTrue(torch.equal(loaded.state_dict()[name], p.float()), name)

    def test_a_bad_export_max_shard_size_is_refused_before_training(self):
        for value, expected in (("5gb", "ambiguous"), ("5 GB", "expected a whole number"), ("0", "at least one byte"),
                                ("TB", "expected a whole number")):
            with self.subTest(value=value):
                run_dir = os.path.join(self.work, "bad-shard-size")
                result = subprocess.run([forge_bin(), "train", "--checkpoint.export_max_shard_size", value,
                                         "--training.steps", "1", "--logging.run_dir", run_dir],
                                        capture_output=True, text=True)
                self.assertNotEqual(result.returncode, 0)
                self.assertIn("checkpoint.export_max_shard_size", result.stderr)
                self.assertIn(expected, result.stderr)
                self.assertFalse(os.path.exists(os.path.join(run_dir, "metrics.jsonl")))

    def test_resuming_a_run_that_exported_is_refused_before_training(self):
        run_dir = os.path.join(self.work, "done")
        self.train(run_dir, "--checkpoint.enable", "true")
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            before = f.read()
        result = subprocess.run([forge_bin(), "train", "--checkpoint.initial_load_path", self.source,
                                 "--checkpoint.last_save_in_hf", "true", "--training.seq_len", "32",
                                 "--checkpoint.enable", "true", "--training.steps", "5", "--logging.run_dir", run_dir],
                                capture_output=True, text=True)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("refusing to overwrite", result.stderr)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            self.assertEqual(f.read(), before)

    def test_conflicting_model_key_is_refused_naming_both_values_and_the_file(self):
        run_dir = os.path.join(self.work, "mismatch")
        result = subprocess.run([forge_bin(), "train", "--checkpoint.initial_load_path", self.source,
                                 "--model.num_layers", "3", "--logging.run_dir", run_dir], capture_output=True,
                                text=True)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("model.num_layers = 3 conflicts", result.stderr)
        self.assertIn(os.path.join(self.source, "config.json") + " (num_hidden_layers) gives 2", result.stderr)
        self.assertFalse(os.path.exists(run_dir))
        # The same value as config.json's is no conflict.
        self.train(os.path.join(self.work, "same"), "--model.num_layers", "2", "--model.vocab_size", "32")

    def test_a_folder_that_is_neither_is_refused_saying_what_it_holds(self):
        folder = os.path.join(self.work, "not-a-model")
        os.makedirs(folder)
        open(os.path.join(folder, "pytorch_model.bin"), "w").close()
        result = subprocess.run([forge_bin(), "train", "--checkpoint.initial_load_path", folder], capture_output=True,
                                text=True)
        self.assertEqual(result.returncode, 1)
        self.assertIn("neither a forge checkpoint nor a Hugging Face model", result.stderr)
        self.assertIn("holds pytorch_model.bin", result.stderr)
        self.assertIn("expected a forge checkpoint", result.stderr)

    def test_hf_info_and_info_print_yaml_that_trains_as_is(self):
        out = run([forge_bin(), "hf-info", self.source]).stdout
        self.assertIn("# architecture   2 layers, hidden 64", out)
        exp = os.path.join(self.work, "exp.yaml")
        with open(exp, "w") as f:
            f.write(out)
        run([forge_bin(), "train", exp], cwd=self.work)
        info = run([forge_bin(), "info", self.source]).stdout
        self.assertIn("model            hf", info)
        yaml_text = info[info.index("# The config a run from"):]
        self.assertEqual(yaml_text, out[out.index("# The config a run from"):])
        runs = os.listdir(os.path.join(self.work, "runs"))
        self.assertEqual(len(runs), 1)
        self.assertTrue(runs[0].startswith("hf-"), runs)

    def test_hf_info_help_offers_only_what_it_accepts(self):
        help_text = run([forge_bin(), "hf-info", "--help"]).stdout
        self.assertIn("forge hf-info DIR [--section.key VALUE ...]", help_text)
        out = run([forge_bin(), "hf-info", self.source, "--training.seq_len", "64"]).stdout
        self.assertIn("seq_len: 64", out)
        self.assertNotIn("Overrides", run([forge_bin(), "keys", "--help"]).stdout)


# Period of the training token stream: it divides seq_len, so every sample of the packed
# stream is the same tokens and the first batch is known whatever the shuffle.
PERIOD, FT_SEQ = 8, 16

FINE_TUNE_CASES = [
    # (folder, family, config, saved dtype, export_dtype override or None, expected export dtype)
    ("TinyLlama-ft", "llama",
     dict(vocab_size=48, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64,
          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
     torch.bfloat16, None, torch.bfloat16),
    ("TinyMistral-nowindow", "mistral",
     dict(vocab_size=48, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
     torch.float32, "fp16", torch.float16),
    ("TinyMistral-window", "mistral",
     dict(vocab_size=48, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, sliding_window=5, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
     torch.float32, "bf16", torch.bfloat16),
]


class FineTuneFromTheFolderAlone(unittest.TestCase):
    """Only checkpoint.initial_load_path (and the data and step keys): the architecture and
    the run's name come from the folder, the first loss is transformers' on the same batch,
    and the export is the source's class in the asked (or the source's) dtype."""

    def write_dataset(self, work):
        pattern = np.random.RandomState(5).randint(0, 48, size=PERIOD).tolist()
        documents = [[pattern * 4] for _ in range(24)]
        spec = os.path.join(work, "docs.json")
        with open(spec, "w") as f:
            json.dump({"dtype": "uint16", "documents": documents}, f)
        prefix = os.path.join(work, "data")
        run([tool("forge_write_indexed"), prefix, spec])
        return prefix, (pattern * (FT_SEQ // PERIOD + 1))[:FT_SEQ + 1]

    def check_case(self, folder, family, config, saved, export_dtype, expected_dtype):
        work = scratch_dir()
        source = os.path.join(work, folder)
        model = random_model(family, config, seed=11)
        model.to(saved).save_pretrained(source)
        prefix, sample = self.write_dataset(work)
        extra = ["--checkpoint.export_dtype", export_dtype] if export_dtype else []
        run([forge_bin(), "train", "--checkpoint.initial_load_path", source, "--data.source", "indexed",
             "--data.path", prefix, "--training.seq_len", str(FT_SEQ), "--training.local_batch_size", "2",
             "--training.steps", "2", "--eval.interval", "0", "--checkpoint.last_save_in_hf", "true", *extra],
            cwd=work)
        runs = os.listdir(os.path.join(work, "runs"))
        self.assertEqual(len(runs), 1)
        self.assertTrue(runs[0].startswith(folder + "-"), runs)
        run_dir = os.path.join(work, "runs", runs[0])
        with open(os.path.join(run_dir, "config.yaml")) as f:
            self.assertIn(f"name: {folder}", f.read())

        reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="eager")
        ids = torch.tensor([sample])
        with torch.no_grad():
            expected = reference(input_ids=ids, labels=ids).loss.item()
        first = records(run_dir, "train")[0]["loss"]
        print(f"{folder}: first loss {first:.6f}, transformers {expected:.6f}")
        self.assertLess(abs(first - expected) / expected, TOLERANCE)

        exported = os.path.join(run_dir, "hf")
        with open(os.path.join(exported, "config.json")) as f:
            written = json.load(f)
        self.assertEqual(written["architectures"], [type(model).__name__])
        if family == "mistral":
            self.assertEqual(written["sliding_window"], config["sliding_window"])
        loaded = AutoModelForCausalLM.from_pretrained(exported, dtype="auto")
        self.assertEqual(type(loaded).__name__, type(model).__name__)
        self.assertEqual({p.dtype for p in loaded.parameters()}, {expected_dtype})

    def test_cases(self):
        for case in FINE_TUNE_CASES:
            with self.subTest(case[0]):
                self.check_case(*case)


if __name__ == "__main__":
    unittest.main()
