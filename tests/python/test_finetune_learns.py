"""A real fine-tune, end to end through forge's commands, that shows learning: instruction
data in JSON Lines ("reverse: abcd" -> "dcba") prepared with `forge prep --format sft`, a
Hugging Face Llama folder as the start (one setting: checkpoint.initial_load_path), a full
fine-tune, then `forge eval` on held-out examples (the loss falls far below the start's)
and `forge generate` (greedy answers to held-out prompts become right).

The start is a small randomly initialized Llama saved by transformers with a byte-level
tokenizer (no pretrained weights can be downloaded here), so this checks that the whole
fine-tuning path learns and that eval and generate read what training wrote; it is not a
claim about any model's quality."""
import json
import os
import random
import shutil
import string
import subprocess
import unittest

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from forge_test_util import forge_bin, scratch_dir

LETTERS = string.ascii_lowercase[:12]  # a-l: 20,736 words of four letters


def byte_tokenizer(directory):
    """Byte-level BPE without merges (every character one token), Llama 3 style specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(vocab_size=256 + len(specials), special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["reverse: abcd\n"], trainer)
    path = os.path.join(directory, "tokenizer.json")
    tok.save(path)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, f)
    return tok


def example(word):
    return {"prompt": f"reverse: {word}\n", "completion": word[::-1]}


def forge(*args):
    result = subprocess.run([forge_bin(), *args], capture_output=True, text=True, errors="replace")
    if result.returncode != 0:
        raise AssertionError(f"forge {' '.join(args)} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


class FineTuneLearns(unittest.TestCase):
    def test_eval_loss_falls_and_generated_answers_become_right(self):
        root = scratch_dir()
        self.addCleanup(shutil.rmtree, root, ignore_errors=True)
        base = os.path.join(root, "base")
        os.makedirs(base)
        tok = byte_tokenizer(base)
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            bos_token_id=tok.token_to_id("<|begin_of_text|>"), eos_token_id=tok.token_to_id("<|end_of_text|>"),
            tie_word_embeddings=False))
        model.save_pretrained(base)

        rng = random.Random(1)
        words = sorted({"".join(rng.choice(LETTERS) for _ in range(4)) for _ in range(4000)})
        rng.shuffle(words)
        held_out, train = words[:40], words[40:]
        for name, items in (("train", train), ("eval", held_out)):
            with open(os.path.join(root, name + ".jsonl"), "w") as f:
                for w in items:
                    f.write(json.dumps(example(w)) + "\n")
            forge("prep", "--format", "sft", "--input", os.path.join(root, name + ".jsonl"), "--tokenizer", base,
                  "--output-prefix", os.path.join(root, name), "--prepend-bos")

        data = ["--data.source", "sft", "--data.split", "1", "--training.seq_len", "63",
                "--training.local_batch_size", "8"]
        def evaluate(model_path):
            with open(self.eval_json(root, model_path, data), encoding="utf-8") as f:
                return json.load(f)["loss"]

        before = evaluate(base)

        run_dir = os.path.join(root, "run")
        forge("train", "--checkpoint.initial_load_path", base, "--data.path", os.path.join(root, "train"), *data,
              "--training.steps", "400", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "10",
              "--eval.interval", "0", "--checkpoint.enable", "true", "--checkpoint.interval", "400",
              "--logging.run_dir", run_dir, "--logging.log_interval", "100")
        after = evaluate(run_dir)
        print(f"held-out loss {before:.3f} before, {after:.4f} after")
        self.assertLess(after, 0.1 * before, f"held-out loss {before:.3f} -> {after:.3f}")

        def right_answers(model_path):
            right = 0
            for w in held_out[:10]:
                out = forge("generate", "--model", model_path, "--tokenizer", base, "--prompt", f"reverse: {w}\n",
                            "--max-new-tokens", "5").stdout
                print(f"{os.path.basename(model_path)}: reverse: {w} -> {out.strip()!r}")
                right += out.strip() == w[::-1]
            return right

        self.assertLessEqual(right_answers(base), 1, "greedy answers of the untrained start")
        self.assertGreaterEqual(right_answers(run_dir), 9, "greedy answers to held-out prompts after fine-tuning")

    def eval_json(self, root, model_path, data):
        path = os.path.join(root, f"eval-{len(os.listdir(root))}.json")
        forge("eval", "--model", model_path, "--data.path", os.path.join(root, "eval"), *data, "--split", "train",
              "--batches", "1", "--json", path)
        return path


if __name__ == "__main__":
    unittest.main()
