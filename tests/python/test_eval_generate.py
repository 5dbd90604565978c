"""forge generate and forge eval against transformers on tiny random Hugging Face models.

Greedy generation with forge's KV cache must give transformers' generate(do_sample=False)
token for token (Llama with GQA and tied embeddings, Mistral with a sliding window shorter
than prompt + generation, Mixtral, DeepSeek-V2 and -V3 with Multi-head Latent Attention), and stop where transformers stops at an EOS from
generation_config.json. forge eval's loss on an indexed dataset must equal transformers'
cross-entropy on the same token windows. Plus the refusals: missing model, tokenizer bigger
than the vocabulary, empty prompt, bad sampling parameters."""
import json
import os
import subprocess
import unittest

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from hf_tiny import random_model
from forge_test_util import forge_bin, run, scratch_dir
from tokenizer_fixtures import corpus, train_byte_level

MAX_NEW = 24


def forge(*args, check=True):
    """Runs forge; stdout as bytes (a random model's text need not be valid UTF-8), stderr as text."""
    result = subprocess.run([forge_bin(), *args], capture_output=True)
    result.stderr = result.stderr.decode("utf-8", errors="replace")
    if check and result.returncode != 0:
        raise AssertionError(f"forge {args} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


class EvalGenerate(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.work = scratch_dir()
        cls.tokenizer = train_byte_level(cls.work, corpus(400))
        from tokenizers import Tokenizer
        cls.hf_tokenizer = Tokenizer.from_file(cls.tokenizer)
        cls.vocab = cls.hf_tokenizer.get_vocab_size()

    def save(self, name, family, config, seed, eos=None):
        model = random_model(family, dict(vocab_size=self.vocab, **config), seed)
        path = os.path.join(self.work, name)
        model.generation_config.eos_token_id = eos
        model.generation_config.bos_token_id = None
        model.generation_config.pad_token_id = None
        model.save_pretrained(path)
        return model, path

    def forge_generate(self, path, prompt, *extra):
        out = os.path.join(self.work, "generate.json")
        result = forge("generate", "--model", path, "--tokenizer", self.tokenizer, "--prompt", prompt,
                       "--max-new-tokens", str(MAX_NEW), "--json", out, *extra)
        with open(out) as f:
            report = json.load(f)
        return report, result

    def transformers_greedy(self, model, prompt_tokens, eos=None):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_tokens]), max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=eos, pad_token_id=0, attention_mask=torch.ones(1, len(prompt_tokens),
                                                                                             dtype=torch.long))
        return out[0, len(prompt_tokens):].tolist()

    def check_greedy(self, name, family, config):
        model, path = self.save(name, family, config, seed=3)
        report, result = self.forge_generate(path, "The quick brown fox jumps over the lazy dog. The answer is")
        prompt = report["prompt_tokens"]
        self.assertEqual(prompt[0], self.hf_tokenizer.token_to_id("<|begin_of_text|>"))  # BOS put first
        self.assertEqual(prompt[1:], self.hf_tokenizer.encode(
            "The quick brown fox jumps over the lazy dog. The answer is", add_special_tokens=False).ids)
        expected = self.transformers_greedy(model, prompt)
        self.assertEqual(report["new_tokens"], expected, name)
        self.assertEqual(report["stop"], "max_new_tokens")
        decoded = self.hf_tokenizer.decode(expected, skip_special_tokens=False)
        if "\ufffd" not in decoded:  # the streamed text is the whole text, as the tokenizer decodes it
            self.assertEqual(result.stdout.decode("utf-8"), decoded + "\n")
            self.assertEqual(report["text"], decoded)
        return model, path, prompt, expected

    def test_greedy_llama_gqa_tied_matches_transformers(self):
        self.check_greedy("llama", "llama", dict(hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                                                 num_attention_heads=6, num_key_value_heads=2,
                                                 tie_word_embeddings=True, max_position_embeddings=128,
                                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))

    def test_greedy_mistral_sliding_window_matches_transformers(self):
        self.check_greedy("mistral", "mistral", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=5,
                                                     max_position_embeddings=128,
                                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))

    def test_greedy_mixtral_matches_transformers(self):
        self.check_greedy("mixtral", "mixtral", dict(hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                                     num_experts_per_tok=2, max_position_embeddings=128,
                                                     sliding_window=None,
                                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))

    def test_greedy_deepseek_v2_matches_transformers(self):
        # Multi-head Latent Attention with values of their own head dim, a dense first block,
        # shared experts, group-limited greedy routing scaled and not renormalized, YaRN.
        self.check_greedy("deepseek_v2", "deepseek_v2", dict(
            hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=6, num_experts_per_tok=2,
            n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=128, topk_method="group_limited_greedy",
            n_group=3, topk_group=2, norm_topk_prob=False, routed_scaling_factor=2.0,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16, "mscale": 0.707, "mscale_all_dim": 0.707}))

    def test_greedy_deepseek_v3_matches_transformers(self):
        # A compressed query, sigmoid scores plus the routing bias in the best groups, renormalized.
        self.check_greedy("deepseek_v3", "deepseek_v3", dict(
            hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3,
            n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=128, n_group=4, topk_group=2,
            norm_topk_prob=True, routed_scaling_factor=2.5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))

    def test_stops_at_eos_as_transformers_does(self):
        config = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        model, path, prompt, tokens = self.check_greedy("llama_eos", "llama", config)
        stop = tokens[6]
        first = tokens.index(stop)
        model.generation_config.eos_token_id = [self.vocab - 1, stop]
        model.generation_config.save_pretrained(path)
        report, result = self.forge_generate(path, "The quick brown fox jumps over the lazy dog. The answer is")
        self.assertEqual(report["stop"], "eos")
        self.assertEqual(report["new_tokens"], tokens[:first + 1])
        self.assertEqual(report["new_tokens"], self.transformers_greedy(model, prompt, eos=[self.vocab - 1, stop]))
        ignored, _ = self.forge_generate(path, "The quick brown fox jumps over the lazy dog. The answer is",
                                         "--ignore-eos")
        self.assertEqual(ignored["new_tokens"], tokens)

    def test_sampling_is_seeded_and_stays_in_top_k(self):
        _, path = self.save("llama_sample", "llama", dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                                                          num_attention_heads=2, num_key_value_heads=1), seed=5)
        args = ["--temperature", "0.8", "--top-k", "5", "--top-p", "0.9", "--seed", "7"]
        a, _ = self.forge_generate(path, "hello world", *args)
        b, _ = self.forge_generate(path, "hello world", *args)
        c, _ = self.forge_generate(path, "hello world", "--temperature", "0.8", "--seed", "8")
        self.assertEqual(a["new_tokens"], b["new_tokens"])
        self.assertNotEqual(a["new_tokens"], c["new_tokens"])
        k1, _ = self.forge_generate(path, "hello world", "--temperature", "1.5", "--top-k", "1", "--seed", "3")
        greedy, _ = self.forge_generate(path, "hello world")
        self.assertEqual(k1["new_tokens"], greedy["new_tokens"])  # top-k 1 is greedy

    def test_bad_inputs_are_refused(self):
        _, path = self.save("llama_bad", "llama", dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                                                       num_attention_heads=2, num_key_value_heads=1), seed=1)
        cases = [
            (["--model", os.path.join(self.work, "missing"), "--prompt", "x"], "is not a directory"),
            (["--model", self.work, "--prompt", "x"], "no config.json"),
            (["--model", path, "--tokenizer", self.tokenizer], "the prompt is empty"),
            (["--model", path, "--tokenizer", self.tokenizer, "--prompt", "x", "--top-p", "0"], "--top-p 0"),
            (["--model", path, "--tokenizer", self.tokenizer, "--prompt", "x", "--top-k", "3"],
             "give --temperature > 0"),
            (["--model", path, "--tokenizer", self.tokenizer, "--prompt", "x", "--temperature", "-1"],
             "--temperature -1"),
            (["--model", path, "--tokenizer", self.tokenizer, "--prompt", "x", "--max-new-tokens", "0"],
             "--max-new-tokens 0"),
            (["--model", path, "--prompt", "x"], "give --tokenizer to use another"),
            (["--model", path, "--tokenizer", self.tokenizer, "--prompt-file", os.path.join(self.work, "nope.txt")],
             "--prompt-file"),
        ]
        small = random_model("llama", dict(vocab_size=50, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1), 0)
        small_path = os.path.join(self.work, "small")
        small.save_pretrained(small_path)
        cases.append((["--model", small_path, "--tokenizer", self.tokenizer, "--prompt", "x"],
                      "the model's vocabulary is 50"))
        for args, message in cases:
            result = forge("generate", *args, check=False)
            self.assertEqual(result.returncode, 1, f"{args}: {result.stderr}")
            self.assertIn(message, result.stderr, args)

    def test_eval_loss_matches_transformers(self):
        model, path = self.save("llama_eval", "llama",
                                dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=64,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), seed=9)
        seq, windows = 16, 3
        tokens = np.random.default_rng(0).integers(0, self.vocab, size=windows * seq + 1)
        prefix = os.path.join(self.work, "eval_data")
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
        builder.add_item(torch.tensor(tokens, dtype=torch.int64))
        builder.end_document()
        builder.finalize(prefix + ".idx")
        out = os.path.join(self.work, "eval.json")
        result = forge("eval", "--model", path, "--data.source", "indexed", "--data.path", prefix, "--data.split",
                       "0,1,0", "--training.seq_len", str(seq), "--training.local_batch_size", "1",
                       "--training.global_batch_size", "1", "--batches", str(windows), "--json", out)
        with open(out) as f:
            report = json.load(f)
        losses = []
        with torch.no_grad():
            for w in range(windows):
                window = torch.tensor(tokens[w * seq:w * seq + seq + 1], dtype=torch.long)
                logits = model(input_ids=window[None, :-1]).logits[0]
                losses.append(torch.nn.functional.cross_entropy(logits.double(), window[1:], reduction="sum"))
        expected = float(sum(losses)) / (windows * seq)
        self.assertEqual(report["tokens"], windows * seq)
        self.assertEqual(report["samples_in_split"], windows)
        self.assertLess(abs(report["loss"] - expected) / expected, 1e-5, result.stdout)
        self.assertAlmostEqual(report["perplexity"], float(np.exp(report["loss"])), places=6)
        self.assertIn(f"loss {report['loss']:.6f}", result.stdout.decode())
        # data.validation_path: the same tokens as three documents, read in file order and
        # unshuffled, so two batches are the first two windows, for validation and test.
        valid = os.path.join(self.work, "eval_valid")
        builder = IndexedDatasetBuilder(valid + ".bin", dtype=np.int32)
        for document in np.split(tokens, [5, 27]):
            builder.add_item(torch.tensor(document, dtype=torch.int64))
            builder.end_document()
        builder.finalize(valid + ".idx")
        for split in ("validation", "test"):
            first = forge("eval", "--model", path, "--data.source", "indexed", "--data.path", prefix,
                          "--data.validation_path", valid, "--split", split, "--training.seq_len", str(seq),
                          "--training.local_batch_size", "1", "--training.global_batch_size", "1", "--batches", "2",
                          "--json", out)
            with open(out) as f:
                report = json.load(f)
            expected = float(losses[0] + losses[1]) / (2 * seq)
            self.assertEqual(report["samples_in_split"], windows)
            self.assertLess(abs(report["loss"] - expected) / expected, 1e-5, first.stdout)
        # An override that contradicts the model's architecture is refused.
        bad = forge("eval", "--model", path, "--training.seq_len", "16", "--model.num_layers", "3", check=False)
        self.assertEqual(bad.returncode, 1)
        self.assertIn("model.num_layers: 3 here, 2 in the model", bad.stderr)

    def test_eval_of_a_run_gives_its_validation_loss_and_skips_a_damaged_checkpoint(self):
        run_dir = os.path.join(self.work, "run")
        common = ["--training.steps", "4", "--training.seq_len", "32", "--eval.interval", "2", "--eval.steps", "2"]
        run([forge_bin(), "train", *common, "--logging.run_dir", run_dir, "--checkpoint.enable", "true",
             "--checkpoint.interval", "2"])
        evals = {}
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for record in map(json.loads, f):
                if record["type"] == "eval":
                    evals[record["step"]] = record["loss"]
        out = os.path.join(self.work, "run_eval.json")
        result = forge("eval", "--model", run_dir, "--json", out)  # the run's config.yaml is the experiment
        self.assertIn("config.yaml (the run's own", result.stdout.decode())
        with open(out) as f:
            self.assertAlmostEqual(json.load(f)["loss"], evals[4], places=9)
        # Given explicitly, after --model.
        forge("eval", "--model", run_dir, os.path.join(run_dir, "config.yaml"), "--json", out)
        with open(out) as f:
            self.assertAlmostEqual(json.load(f)["loss"], evals[4], places=9)
        # The newest checkpoint damaged: the one before it is evaluated, with a warning.
        shard = os.path.join(run_dir, "checkpoints", "step-4", "rank-0.bin")
        with open(shard, "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
        result = forge("eval", "--model", run_dir, *common, "--json", out)
        self.assertIn("step-4' cannot be loaded", result.stderr)
        with open(out) as f:
            self.assertAlmostEqual(json.load(f)["loss"], evals[2], places=9)
        only = forge("eval", "--model", os.path.join(run_dir, "checkpoints", "step-4"), *common, check=False)
        self.assertEqual(only.returncode, 1)
        self.assertIn("CRC", only.stderr)


if __name__ == "__main__":
    unittest.main()
