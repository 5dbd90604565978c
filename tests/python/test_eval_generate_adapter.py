"""forge eval and forge generate with a LoRA adapter on a base model, against transformers + PEFT.

A PEFT adapter (non-zero A and B, saved by PEFT) given as --adapter on a tiny random Hugging
Face Llama: forge eval's loss equals the PeftModel's cross-entropy and forge generate's
greedy tokens equal the PeftModel's generate(do_sample=False). A forge LoRA run directory as
--model finds its base (checkpoint.initial_load_path) and its adapter (<run_dir>/adapter):
the same loss and tokens as PEFT with that adapter, and as --model BASE --adapter
RUN/adapter. Plus the refusals, each naming the file, key or tensor."""
import json
import os
import shutil
import subprocess
import unittest

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaForCausalLM

from hf_tiny import ROPE, edit_peft_adapter, random_model
from forge_test_util import forge_bin, scratch_dir
from tokenizer_fixtures import corpus, train_byte_level

MAX_NEW = 16
SEQ, WINDOWS = 16, 3
PROMPT = "The quick brown fox jumps over the lazy dog. The answer is"


def forge(*args, check=True):
    result = subprocess.run([forge_bin(), *args], capture_output=True)
    result.stderr = result.stderr.decode("utf-8", errors="replace")
    if check and result.returncode != 0:
        raise AssertionError(f"forge {args} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def random_llama(vocab, seed, hidden=48):
    return random_model("llama", dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False, rope_parameters=ROPE), seed)


class EvalGenerateAdapter(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.work = scratch_dir()
        cls.tokenizer = train_byte_level(cls.work, corpus(400))
        from tokenizers import Tokenizer
        cls.vocab = Tokenizer.from_file(cls.tokenizer).get_vocab_size()
        cls.base = os.path.join(cls.work, "base")
        random_llama(cls.vocab, seed=11).save_pretrained(cls.base)
        # A PEFT adapter with non-zero A and B (PEFT starts B at zero), saved by PEFT.
        peft = get_peft_model(random_llama(cls.vocab, seed=11),
                              LoraConfig(r=4, lora_alpha=12, lora_dropout=0.1, task_type="CAUSAL_LM",
                                         target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
        torch.manual_seed(3)
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_" in n:
                    p.normal_(0.0, 0.3)
        cls.adapter = os.path.join(cls.work, "peft_adapter")
        peft.save_pretrained(cls.adapter)
        tokens = np.random.default_rng(0).integers(0, cls.vocab, size=WINDOWS * SEQ + 1)
        cls.tokens = tokens
        cls.data = os.path.join(cls.work, "eval_data")
        builder = IndexedDatasetBuilder(cls.data + ".bin", dtype=np.int32)
        builder.add_item(torch.tensor(tokens, dtype=torch.int64))
        builder.end_document()
        builder.finalize(cls.data + ".idx")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.work, ignore_errors=True)

    def peft_model(self, adapter):
        base = LlamaForCausalLM.from_pretrained(self.base, attn_implementation="eager").float()
        return PeftModel.from_pretrained(base, adapter).eval()

    def peft_loss(self, model):
        losses = []
        with torch.no_grad():
            for w in range(WINDOWS):
                window = torch.tensor(self.tokens[w * SEQ:w * SEQ + SEQ + 1], dtype=torch.long)
                logits = model(input_ids=window[None, :-1]).logits[0]
                losses.append(torch.nn.functional.cross_entropy(logits.double(), window[1:], reduction="sum"))
        return float(sum(losses)) / (WINDOWS * SEQ)

    def peft_greedy(self, model, prompt):
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=None, pad_token_id=0,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        return out[0, len(prompt):].tolist()

    def forge_eval(self, *model_args):
        out = os.path.join(self.work, "eval.json")
        forge("eval", *model_args, "--data.source", "indexed", "--data.path", self.data, "--data.split", "0,1,0",
              "--training.seq_len", str(SEQ), "--training.local_batch_size", "1", "--training.global_batch_size", "1",
              "--batches", str(WINDOWS), "--json", out)
        with open(out) as f:
            return json.load(f)

    def forge_generate(self, *model_args):
        out = os.path.join(self.work, "generate.json")
        result = forge("generate", *model_args, "--tokenizer", self.tokenizer, "--prompt", PROMPT,
                       "--max-new-tokens", str(MAX_NEW), "--ignore-eos", "--json", out)
        with open(out) as f:
            return json.load(f), result

    def check_against_peft(self, adapter, *model_args):
        peft = self.peft_model(adapter)
        report = self.forge_eval(*model_args)
        expected = self.peft_loss(peft)
        self.assertEqual(report["tokens"], WINDOWS * SEQ)
        self.assertLess(abs(report["loss"] - expected) / expected, 1e-5, (report, expected))
        generated, result = self.forge_generate(*model_args)
        self.assertIn("LoRA adapter", result.stderr)
        self.assertEqual(generated["new_tokens"], self.peft_greedy(peft, generated["prompt_tokens"]))
        return report, generated

    def test_peft_adapter_on_a_hugging_face_model_matches_peft(self):
        report, generated = self.check_against_peft(self.adapter, "--model", self.base, "--adapter", self.adapter)
        self.assertEqual(report["adapter"], self.adapter)
        # The adapter changes the model: without it, other loss and tokens.
        plain = self.forge_eval("--model", self.base)
        self.assertGreater(abs(plain["loss"] - report["loss"]), 1e-3)
        plain_generated, _ = self.forge_generate("--model", self.base)
        self.assertNotEqual(plain_generated["new_tokens"], generated["new_tokens"])

    def test_lora_run_directory_as_model_finds_its_base_and_adapter(self):
        run_dir = os.path.join(self.work, "lora_run")
        forge("train", "--checkpoint.initial_load_path", self.base, "--lora.rank", "2", "--lora.alpha", "6",
              "--lora.target_modules", "q_proj,k_proj,gate_proj,up_proj", "--training.local_batch_size", "2",
              "--training.seq_len", "16", "--training.steps", "3", "--optimizer.lr", "0.05",
              "--lr_scheduler.warmup_steps", "0", "--eval.interval", "0", "--data.synthetic_order", "1",
              "--logging.run_dir", run_dir)
        adapter = os.path.join(run_dir, "adapter")
        report, generated = self.check_against_peft(adapter, "--model", run_dir)
        self.assertIn(run_dir, report["source"])
        self.assertEqual((report["adapter"], generated["adapter"]), (adapter, adapter))
        explicit = self.forge_eval("--model", self.base, "--adapter", adapter)
        self.assertEqual(explicit["loss"], report["loss"])
        explicit_generated, _ = self.forge_generate("--model", self.base, "--adapter", adapter)
        self.assertEqual(explicit_generated["new_tokens"], generated["new_tokens"])

        refused = forge("generate", "--model", run_dir, "--adapter", self.adapter, "--prompt", "x", check=False)
        self.assertEqual(refused.returncode, 1)
        self.assertIn("is a LoRA run", refused.stderr)
        # A run whose settings the adapter does not have (its config.yaml edited) is refused.
        with open(os.path.join(run_dir, "config.yaml")) as f:
            text = f.read()
        edited = os.path.join(self.work, "edited_run")
        shutil.copytree(run_dir, edited)
        with open(os.path.join(edited, "config.yaml"), "w") as f:
            f.write(text.replace("rank: 2", "rank: 8"))
        mismatch = forge("generate", "--model", edited, "--prompt", "x", check=False)
        self.assertEqual(mismatch.returncode, 1)
        self.assertIn("adapter_config.json: r is 2, but lora.rank is 8", mismatch.stderr)
        shutil.rmtree(os.path.join(edited, "adapter"))
        missing = forge("generate", "--model", edited, "--prompt", "x", check=False)
        self.assertIn("has no adapter/ yet", missing.stderr)

    def bad_adapter(self, name, edit_config=None, tensors=None):
        path = os.path.join(self.work, name)
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(self.adapter, path)
        edit_peft_adapter(path, edit_config, tensors)
        return path

    def test_bad_adapters_are_refused_naming_the_file(self):
        q_b = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"

        def drop(t):
            del t[q_b]

        def widen(t):
            t[q_b] = torch.zeros(48, 5)

        def extra(t):
            t["base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"] = torch.zeros(4, 48)

        cases = [
            (os.path.join(self.work, "nowhere"), "is not a directory"),
            (self.bad_adapter("dora", lambda c: c.update(use_dora=True)), "use_dora is true"),
            (self.bad_adapter("head", lambda c: c.update(target_modules=["q_proj", "lm_head"])),
             "target_modules names 'lm_head'"),
            (self.bad_adapter("rank", lambda c: c.update(r=0)), "r is 0"),
            (self.bad_adapter("alpha", lambda c: c.pop("lora_alpha")), "lora_alpha is missing"),
            (self.bad_adapter("missing_tensor", tensors=drop), f"no tensor '{q_b}'"),
            (self.bad_adapter("shape", tensors=widen), f"tensor '{q_b}' is [48, 5], expected [48, 4]"),
            (self.bad_adapter("extra", tensors=extra), "is not an adapter of this model"),
        ]
        for adapter, message in cases:
            result = forge("generate", "--model", self.base, "--adapter", adapter, "--tokenizer", self.tokenizer,
                           "--prompt", "x", check=False)
            self.assertEqual(result.returncode, 1, f"{adapter}: {result.stderr}")
            self.assertIn(message, result.stderr, adapter)
            if "nowhere" not in adapter:
                self.assertIn(adapter, result.stderr)
        # An adapter trained for another model (hidden size 32, not 48).
        other = os.path.join(self.work, "other_model")
        peft = get_peft_model(random_llama(self.vocab, seed=1, hidden=32),
                              LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj", "o_proj",
                                                                             "down_proj"]))
        peft.save_pretrained(other)
        result = forge("eval", "--model", self.base, "--adapter", other, "--training.seq_len", "16", check=False)
        self.assertEqual(result.returncode, 1)
        self.assertIn(os.path.join(other, "adapter_model.safetensors"), result.stderr)
        self.assertIn("expected [4, 48]", result.stderr)


if __name__ == "__main__":
    unittest.main()
