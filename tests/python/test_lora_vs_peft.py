"""forge's LoRA against Hugging Face PEFT on transformers' Llama, on tiny random configs
(several ranks, alphas and target sets; dropout off):
  - a PEFT-saved adapter loads into forge (lora.adapter_path's loader) and forge's logits and
    adapter gradients equal PEFT's (float64) within 1e-4 relative;
  - the adapter forge saves loads into peft.PeftModel.from_pretrained with the same logits;
  - forge's merged export equals PEFT's merge_and_unload();
  - adapters that do not match the run are refused naming the file and what differs."""
import json
import os
import unittest

import numpy as np
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_tiny import ROPE, edit_peft_adapter, random_model
from forge_test_util import relative_error, run, scratch_dir, tool

TOLERANCE = 1e-4
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

CASES = [
    dict(name="qv_r2", rank=2, alpha=4.0, targets="q_proj,v_proj", heads=4, kv_heads=2, layers=2, tied=False),
    dict(name="all_linear_r4", rank=4, alpha=8.0, targets="all-linear", heads=4, kv_heads=4, layers=2, tied=False),
    dict(name="k_o_up_r3_tied", rank=3, alpha=5.0, targets="k_proj,o_proj,up_proj", heads=6, kv_heads=2, layers=1,
         tied=True),
    dict(name="gate_down_r1", rank=1, alpha=16.0, targets="gate_proj,down_proj", heads=2, kv_heads=1, layers=3,
         tied=False),
]


def base_model(case, seed):
    return random_model("llama", dict(vocab_size=53, hidden_size=24, intermediate_size=40,
                                      num_hidden_layers=case["layers"], num_attention_heads=case["heads"],
                                      num_key_value_heads=case["kv_heads"], head_dim=24 // case["heads"],
                                      max_position_embeddings=64, tie_word_embeddings=case["tied"],
                                      rope_parameters=ROPE), seed)


def peft_config(case):
    targets = "all-linear" if case["targets"] == "all-linear" else case["targets"].split(",")
    return LoraConfig(r=case["rank"], lora_alpha=case["alpha"], lora_dropout=0.0, target_modules=targets,
                      task_type="CAUSAL_LM")


def lora_grads(model):
    return {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if "lora_" in n}


class LoraVsPeft(unittest.TestCase):
    def prepare(self, case):
        work = scratch_dir()
        model = base_model(case, seed=sum(map(ord, case["name"])))
        model.save_pretrained(os.path.join(work, "base"))
        peft = get_peft_model(model, peft_config(case))
        with torch.no_grad():  # B starts at zero in PEFT; random A and B exercise every path
            for n, p in peft.named_parameters():
                if "lora_" in n:
                    p.normal_(0.0, 0.4)
        peft.save_pretrained(os.path.join(work, "peft_adapter"))
        b, s = 2, 7
        tokens = torch.randint(0, 53, (b, s), dtype=torch.int32)
        targets = torch.randint(0, 53, (b, s), dtype=torch.int32)
        targets[0, 0] = -100
        tokens.numpy().tofile(os.path.join(work, "tokens.bin"))
        targets.numpy().tofile(os.path.join(work, "targets.bin"))
        with open(os.path.join(work, "lora.json"), "w") as f:
            json.dump(dict(rank=case["rank"], alpha=case["alpha"], target_modules=case["targets"], batch=b,
                           seq_len=s), f)
        return work, peft, tokens, targets

    def check_case(self, case):
        work, peft, tokens, targets = self.prepare(case)
        run([tool("forge_lora_reference"), work])
        b, s = tokens.shape

        peft = peft.double()
        peft.zero_grad()
        logits = peft(input_ids=tokens.long()).logits
        loss = F.cross_entropy(logits.reshape(b * s, -1), targets.reshape(-1).long(), ignore_index=-100)
        loss.backward()
        ref = logits.detach().reshape(b * s, -1).numpy()
        mine = np.fromfile(os.path.join(work, "logits.bin"), dtype=np.float32).reshape(b * s, -1)
        err = relative_error(mine.astype(np.float64), ref)
        print(f"{case['name']}: logits rel err {err:.2e}")
        self.assertLess(err, TOLERANCE, "logits of the PEFT adapter loaded into forge")
        with open(os.path.join(work, "loss.json")) as f:
            self.assertAlmostEqual(json.load(f)["loss"], loss.item(), delta=TOLERANCE * loss.item())

        ref_grads = lora_grads(peft)
        forge_grads = load_file(os.path.join(work, "forge_grads", "adapter_model.safetensors"))
        self.assertEqual(sorted(forge_grads), sorted(ref_grads))
        for name, g in ref_grads.items():
            err = relative_error(forge_grads[name].double().numpy(), g.numpy())
            self.assertLess(err, TOLERANCE, f"gradient of {name}")

        # forge's saved adapter in PEFT
        base = AutoModelForCausalLM.from_pretrained(os.path.join(work, "base"), dtype=torch.float64,
                                                    attn_implementation="eager")
        loaded = PeftModel.from_pretrained(base, os.path.join(work, "forge_adapter")).eval()
        with torch.no_grad():
            again = loaded(input_ids=tokens.long()).logits.reshape(b * s, -1).numpy()
        self.assertLess(relative_error(again, ref), 1e-10, "logits of forge's adapter in PEFT")

        # merged export against merge_and_unload
        merged = peft.merge_and_unload().state_dict()
        exported = {}
        for f in os.listdir(os.path.join(work, "merged")):
            if f.endswith(".safetensors"):
                exported.update(load_file(os.path.join(work, "merged", f)))
        for name, t in exported.items():
            err = relative_error(t.double().numpy(), merged[name].numpy())
            self.assertLess(err, 1e-6, f"merged {name}")
        self.assertEqual(set(exported), set(merged) - ({"lm_head.weight"} if case["tied"] else set()))

    def test_cases(self):
        for case in CASES:
            with self.subTest(case["name"]):
                self.check_case(case)

    def refused(self, work, edit_config=None, edit_tensors=None):
        edit_peft_adapter(os.path.join(work, "peft_adapter"), edit_config, edit_tensors)
        result = __import__("subprocess").run([tool("forge_lora_reference"), work], capture_output=True, text=True)
        self.assertEqual(result.returncode, 1, result.stderr)
        return result.stderr

    def test_mismatching_adapters_are_refused(self):
        case = CASES[0]
        work, *_ = self.prepare(case)
        err = self.refused(work, edit_config=lambda c: c.update(r=3))
        self.assertIn("adapter_config.json: r is 3, but lora.rank is 2", err)
        work, *_ = self.prepare(case)
        err = self.refused(work, edit_config=lambda c: c.update(lora_alpha=1.0))
        self.assertIn("lora_alpha is 1.0, but lora.alpha is 4", err)
        work, *_ = self.prepare(case)
        err = self.refused(work, edit_config=lambda c: c.update(target_modules=["q_proj"]))
        self.assertIn("target_modules are [q_proj], but lora.target_modules is 'q_proj,v_proj'", err)
        work, *_ = self.prepare(case)
        err = self.refused(work, edit_config=lambda c: c.update(use_dora=True))
        self.assertIn("use_dora is true", err)
        name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
        work, *_ = self.prepare(case)
        err = self.refused(work, edit_tensors=lambda t: t.update({name: t[name][:, :1].contiguous()}))
        self.assertIn(f"adapter_model.safetensors: tensor '{name}' is [12, 1], expected [12, 2]", err)
        work, *_ = self.prepare(case)
        err = self.refused(work, edit_tensors=lambda t: t.pop(name))
        self.assertIn(f"no tensor '{name}'", err)
        extra = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
        work, *_ = self.prepare(case)
        err = self.refused(work, edit_tensors=lambda t: t.update({extra: torch.zeros(2, 24)}))
        self.assertIn(f"tensor '{extra}' is not an adapter of this model", err)


if __name__ == "__main__":
    unittest.main()
