"""The whole CPU model against PyTorch (Hugging Face transformers' Llama and Mistral, in
float64) on random tiny configs: logits and the gradient of every parameter must agree
within 1e-4 relative error. Covers MHA, GQA at several ratios, sliding windows, tied
embeddings, Llama 3.1 rope scaling, masked targets, and Mixture-of-Experts blocks against
transformers' Mixtral (model.num_experts: the router, the experts' stacked weights, top-1
and top-2 routing)."""
import json
import os
import unittest

import numpy as np
import torch
import torch.nn.functional as F
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig,
                          MixtralForCausalLM)

from forge_test_util import relative_error, run, scratch_dir, tool
from hf_tiny import published_names

TOLERANCE = 1e-4

CASES = [
    dict(name="mha", vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4, ffn_hidden_size=40,
         batch=2, seq_len=9),
    dict(name="gqa2", vocab_size=64, hidden_size=48, num_layers=2, num_heads=6, num_kv_heads=3, ffn_hidden_size=72,
         batch=1, seq_len=17),
    dict(name="gqa4_llama3_rope", vocab_size=50, hidden_size=64, num_layers=1, num_heads=8, num_kv_heads=2,
         ffn_hidden_size=96, batch=2, seq_len=33, rope_theta=500000.0,
         rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=16)),
    dict(name="mqa_tied_headdim", vocab_size=37, hidden_size=24, num_layers=3, num_heads=3, num_kv_heads=1,
         head_dim=10, ffn_hidden_size=20, batch=3, seq_len=5, tie_word_embeddings=True),
    dict(name="sliding_window", vocab_size=45, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
         ffn_hidden_size=56, batch=2, seq_len=24, sliding_window=5, mistral=True),
    dict(name="window_1", vocab_size=30, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
         ffn_hidden_size=24, batch=1, seq_len=7, sliding_window=1, mistral=True),
]


def random_cases(count, seed):
    """Tiny configs drawn at random (fixed seed): any head ratio, head size and window."""
    rng = np.random.RandomState(seed)
    cases = []
    for i in range(count):
        kv = int(rng.choice([1, 2, 3]))
        heads = kv * int(rng.choice([1, 2, 4]))
        head_dim = int(rng.choice([4, 6, 8]))
        window = int(rng.choice([0, 0, 3, 7]))
        cases.append(dict(name=f"random{i}", vocab_size=int(rng.randint(20, 80)), hidden_size=heads * head_dim,
                          num_layers=int(rng.randint(1, 4)), num_heads=heads, num_kv_heads=kv,
                          ffn_hidden_size=int(rng.randint(8, 64)), batch=int(rng.randint(1, 4)),
                          seq_len=int(rng.randint(1, 20)), tie_word_embeddings=bool(rng.rand() < 0.3),
                          sliding_window=window, mistral=window > 0))
    return cases


CASES += random_cases(4, seed=2026)

# Mixture-of-Experts (Mixtral): every block's feed-forward is `experts` SwiGLU experts.
CASES += [
    dict(name="mixtral_top2", vocab_size=53, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
         ffn_hidden_size=24, batch=2, seq_len=11, experts=4, top_k=2),
    dict(name="mixtral_top1_tied", vocab_size=40, hidden_size=24, num_layers=1, num_heads=3, num_kv_heads=1,
         ffn_hidden_size=16, batch=1, seq_len=9, experts=3, top_k=1, tie_word_embeddings=True),
    dict(name="mixtral_8_experts", vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=2,
         ffn_hidden_size=20, batch=3, seq_len=6, experts=8, top_k=2),
    # With the balancing loss in the training loss (transformers' output_router_logits).
    dict(name="mixtral_balancing_loss", vocab_size=48, hidden_size=24, num_layers=3, num_heads=4, num_kv_heads=2,
         ffn_hidden_size=16, batch=2, seq_len=7, experts=4, top_k=2, aux=0.3),
]


def hf_model(case):
    common = dict(vocab_size=case["vocab_size"], hidden_size=case["hidden_size"],
                  intermediate_size=case["ffn_hidden_size"], num_hidden_layers=case["num_layers"],
                  num_attention_heads=case["num_heads"], num_key_value_heads=case["num_kv_heads"],
                  head_dim=case.get("head_dim") or case["hidden_size"] // case["num_heads"],
                  rms_norm_eps=case.get("norm_eps", 1e-5), max_position_embeddings=64,
                  tie_word_embeddings=case.get("tie_word_embeddings", False), attn_implementation="eager")
    rope = {"rope_type": "default", "rope_theta": case.get("rope_theta", 10000.0)}
    if "rope_scaling" in case:
        r = case["rope_scaling"]
        rope = {"rope_type": "llama3", "rope_theta": case["rope_theta"], "factor": r["factor"],
                "low_freq_factor": r["low_freq_factor"], "high_freq_factor": r["high_freq_factor"],
                "original_max_position_embeddings": r["original_max_position"]}
    if case.get("experts"):
        config = MixtralConfig(num_local_experts=case["experts"], num_experts_per_tok=case["top_k"],
                               output_router_logits="aux" in case, router_aux_loss_coef=case.get("aux", 0.0),
                               router_jitter_noise=0.0, sliding_window=None, rope_parameters=rope,
                               experts_implementation="eager", **common)
        model = MixtralForCausalLM(config)
    elif case.get("mistral"):
        config = MistralConfig(sliding_window=case["sliding_window"], rope_parameters=rope, **common)
        model = MistralForCausalLM(config)
    else:
        config = LlamaConfig(rope_parameters=rope, **common)
        model = LlamaForCausalLM(config)
    model = model.double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # not all ones, so norm weights are exercised
            else:
                p.normal_(0.0, 0.3)
    return model


def forge_config(case):
    config = {k: case[k] for k in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                   "ffn_hidden_size", "batch", "seq_len")}
    config.update(head_dim=case.get("head_dim", 0), norm_eps=case.get("norm_eps", 1e-5),
                  rope_theta=case.get("rope_theta", 10000.0), max_seq_len=64,
                  sliding_window=case.get("sliding_window", 0),
                  tie_word_embeddings=case.get("tie_word_embeddings", False))
    if "rope_scaling" in case:
        config["rope_scaling"] = case["rope_scaling"]
    if case.get("experts"):
        config.update(num_experts=case["experts"], num_experts_per_tok=case["top_k"],
                      router_aux_loss_coef=case.get("aux", 0.0))
    return config


class ModelVsTorch(unittest.TestCase):
    def check_case(self, case):
        torch.manual_seed(hash(case["name"]) % 1000)
        model = hf_model(case)
        state = published_names(dict(model.state_dict()))
        if case.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)
        work = scratch_dir()
        with open(os.path.join(work, "config.json"), "w") as f:
            json.dump(forge_config(case), f)
        run([tool("forge_model_reference"), "specs", work])
        with open(os.path.join(work, "specs.json")) as f:
            specs = json.load(f)

        # forge's fused tensors are the Hugging Face tensors stacked along dim 0 (a MoE block's
        # experts: the per-expert matrices one after another, NOTE [MoE Hugging Face names]).
        flat = []
        for spec in specs:
            for name, rows in zip(spec["hf_names"], spec["hf_rows"], strict=True):
                self.assertEqual(state[name].shape[0], rows, f"{spec['name']}: rows of {name}")
            t = torch.cat([state.pop(name) for name in spec["hf_names"]], dim=0)
            if len(spec["shape"]) == 3:
                self.assertEqual(list(t.shape), [spec["shape"][0] * spec["shape"][1], spec["shape"][2]], spec["name"])
                t = t.reshape(spec["shape"])
            self.assertEqual(list(t.shape), spec["shape"], spec["name"])
            flat.append(t.reshape(-1))
        self.assertEqual(state, {}, "Hugging Face parameters not covered by forge's layout")
        np.concatenate([t.numpy() for t in flat]).astype(np.float32).tofile(os.path.join(work, "weights.bin"))

        b, s, v = case["batch"], case["seq_len"], case["vocab_size"]
        tokens = torch.randint(0, v, (b, s), dtype=torch.int32)
        targets = torch.randint(0, v, (b, s), dtype=torch.int32)
        targets[0, 0] = -100
        if s > 2:
            targets[-1, s // 2] = -100
        tokens.numpy().tofile(os.path.join(work, "tokens.bin"))
        targets.numpy().tofile(os.path.join(work, "targets.bin"))
        run([tool("forge_model_reference"), "run", work])

        # The reference: the same fp32 weights, computed in float64.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.float().double())
        model.zero_grad()
        out = model(input_ids=tokens.long())
        logits = out.logits
        loss = F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1).long(), ignore_index=-100)
        if "aux" in case:  # MixtralForCausalLM adds it so when given labels
            loss = loss + case["aux"] * out.aux_loss
        loss.backward()

        forge_logits = np.fromfile(os.path.join(work, "logits.bin"), dtype=np.float32).reshape(b * s, v)
        err = relative_error(forge_logits.astype(np.float64), logits.detach().reshape(b * s, v).numpy())
        print(f"{case['name']}: logits rel err {err:.2e}")
        self.assertLess(err, TOLERANCE, "logits")

        with open(os.path.join(work, "loss.json")) as f:
            forge_loss = json.load(f)["loss"]
        self.assertAlmostEqual(forge_loss, loss.item(), delta=TOLERANCE * abs(loss.item()))

        grads = published_names(dict((n, p.grad) for n, p in model.named_parameters()))
        forge_grads = np.fromfile(os.path.join(work, "grads.bin"), dtype=np.float32).astype(np.float64)
        offset = 0
        for spec in specs:
            n = int(np.prod(spec["shape"]))
            mine = forge_grads[offset:offset + n]
            offset += n
            ref = torch.cat([grads[name] for name in spec["hf_names"]], dim=0).reshape(-1).numpy()
            if case.get("top_k") == 1 and ".moe.router." in spec["name"]:
                # Zero in exact arithmetic: under Mixtral's renormalization a top-1 token's one
                # weight is p / p = 1, whatever the router does. transformers renormalizes in
                # fp32 and leaves rounding noise (about 1e-8); forge's backward gives 0.
                self.assertLess(np.abs(ref).max(), 1e-6, spec["name"])
                self.assertLess(np.abs(mine).max(), 1e-6, spec["name"])
                continue
            err = relative_error(mine, ref)
            print(f"  {spec['name']:32s} grad rel err {err:.2e}")
            self.assertLess(err, TOLERANCE, spec["name"])
        self.assertEqual(offset, forge_grads.size)

    def test_cases(self):
        for case in CASES:
            with self.subTest(case["name"]):
                self.check_case(case)


if __name__ == "__main__":
    unittest.main()
