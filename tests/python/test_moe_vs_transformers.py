"""forge's MoE feed-forward ops (ops/moe.h: routing, permutation, per-expert SwiGLU GEMMs,
combine, balancing loss) against transformers in float64 on tiny random configs (several
expert counts and top-k, experts left without tokens): Mixtral's MixtralSparseMoeBlock with
load_balancing_loss_func, DeepSeek-V2's DeepseekV2TopkRouter (group-limited, scaled softmax)
with DeepseekV2Experts, and DeepSeek-V3's DeepseekV3TopkRouter (sigmoid scores, the
correction bias, group-limited top-k, routed_scaling_factor) with DeepseekV3Experts. The
output, the balancing loss, and the gradients of sum(out * dout) (+ coefficient * loss) with
respect to the input, the router and every expert's weights must agree within 1e-4 relative
(forge computes in fp32; transformers' routers work in fp32 too)."""
import os
import unittest

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DeepseekV2Config, DeepseekV3Config, MixtralConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Experts, DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts, DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, load_balancing_loss_func

from forge_test_util import relative_error, run, scratch_dir, tool

TOLERANCE = 1e-4
AUX = 0.02  # Mixtral's router_aux_loss_coef

CASES = [
    dict(tokens=7, hidden=8, ffn=12, experts=4, k=2),
    dict(tokens=16, hidden=16, ffn=24, experts=8, k=2),
    dict(tokens=5, hidden=12, ffn=8, experts=6, k=1),
    dict(tokens=9, hidden=8, ffn=16, experts=8, k=3),
    dict(tokens=2, hidden=8, ffn=8, experts=8, k=1),  # at least 6 experts get no token
]


# DeepSeek-V3's routing: groups of experts, the best topk_group of them kept.
DEEPSEEK_CASES = [
    dict(tokens=7, hidden=8, ffn=12, experts=8, k=2, groups=4, topk_groups=2, normalize=True, scaling=2.5),
    dict(tokens=11, hidden=12, ffn=8, experts=16, k=4, groups=4, topk_groups=3, normalize=True, scaling=1.0),
    dict(tokens=6, hidden=8, ffn=8, experts=6, k=3, groups=1, topk_groups=1, normalize=False, scaling=1.5),
]


# DeepSeek-V2's routing: softmax, group_limited_greedy (groups ranked by their best
# probability) or greedy, never renormalized, scaled by routed_scaling_factor (the 236B
# models' 16).
DEEPSEEK_V2_CASES = [
    dict(tokens=7, hidden=8, ffn=12, experts=8, k=2, groups=4, topk_groups=2, scaling=16.0),
    dict(tokens=11, hidden=12, ffn=8, experts=16, k=3, groups=8, topk_groups=3, scaling=1.0),
    dict(tokens=6, hidden=8, ffn=8, experts=6, k=2, groups=1, topk_groups=1, scaling=2.0),
]


class DeepseekV2RoutedMoe(torch.nn.Module):
    """DeepseekV2Moe's routed half."""

    def __init__(self, case):
        super().__init__()
        grouped = case["topk_groups"] < case["groups"]
        config = DeepseekV2Config(hidden_size=case["hidden"], num_attention_heads=1, num_key_value_heads=1,
                                  moe_intermediate_size=case["ffn"],
                                  n_routed_experts=case["experts"], num_experts_per_tok=case["k"],
                                  topk_method="group_limited_greedy" if grouped else "greedy",
                                  n_group=case["groups"], topk_group=case["topk_groups"],
                                  routed_scaling_factor=case["scaling"])
        self.gate = DeepseekV2TopkRouter(config)
        self.experts = DeepseekV2Experts(config)

    def forward(self, x):
        _, weights, indices = self.gate(x)
        return x + self.experts(x, indices, weights.to(x.dtype))


class DeepseekMoe(torch.nn.Module):
    """DeepseekV3MoE's routed half (its shared experts are a plain SwiGLU MLP)."""

    def __init__(self, case):
        super().__init__()
        config = DeepseekV3Config(hidden_size=case["hidden"], moe_intermediate_size=case["ffn"],
                                  n_routed_experts=case["experts"], num_experts_per_tok=case["k"],
                                  n_group=case["groups"], topk_group=case["topk_groups"],
                                  norm_topk_prob=case["normalize"], routed_scaling_factor=case["scaling"])
        self.gate = DeepseekV3TopkRouter(config)
        self.experts = DeepseekV3Experts(config)

    def forward(self, x):
        _, weights, indices = self.gate(x)
        return x + self.experts(x, indices, weights.to(x.dtype))


def random_block_step(block, rng, t, h, routing_bias=False):
    """A DeepSeek block's random weights (and V3's routing bias), input and output gradient, its
    forward and the backward of sum(out * dout): returns x (with its gradient), dout, out."""
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 0.7)
        if routing_bias:
            block.gate.e_score_correction_bias.copy_(torch.randn(block.gate.weight.shape[0]) * 0.3)
        block.experts.gate_up_proj.normal_(0.0, 0.4)
        block.experts.down_proj.normal_(0.0, 0.4)
    x = torch.tensor(rng.normal(size=(t, h)), dtype=torch.float64, requires_grad=True)
    dout = rng.normal(size=(t, h))
    out = block(x)
    (out * torch.tensor(dout, dtype=torch.float64)).sum().backward()
    return x, dout, out


def reference(case, x, dout):
    config = MixtralConfig(hidden_size=case["hidden"], intermediate_size=case["ffn"],
                           num_local_experts=case["experts"], num_experts_per_tok=case["k"], router_jitter_noise=0.0)
    block = MixtralSparseMoeBlock(config).double()
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 0.7)
        block.experts.gate_up_proj.normal_(0.0, 0.4)
        block.experts.down_proj.normal_(0.0, 0.4)
    x = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    out = x + block(x.view(1, case["tokens"], case["hidden"])).view(case["tokens"], case["hidden"])
    aux = load_balancing_loss_func((F.linear(x, block.gate.weight),), case["experts"], case["k"])
    ((out * torch.tensor(dout, dtype=torch.float64)).sum() + AUX * aux).backward()
    return block, out.detach().numpy(), float(aux.detach()), x.grad.numpy()


def run_forge(shape_line, arrays):
    """Writes the inputs, runs forge_moe_reference, returns a reader of its fp32 outputs."""
    d = scratch_dir()
    with open(os.path.join(d, "shape"), "w") as s:
        s.write(shape_line + "\n")
    for name, value in arrays.items():
        value.astype(np.float32).tofile(os.path.join(d, name))
    run([tool("forge_moe_reference"), d])

    def got(name, shape=None):
        if name == "aux":
            with open(os.path.join(d, "aux")) as a:
                return float(a.read())
        return np.fromfile(os.path.join(d, name), dtype=np.float32).astype(np.float64).reshape(shape)

    return got


class MoeVsTransformers(unittest.TestCase):
    def test_cases(self):
        rng = np.random.RandomState(20)
        torch.manual_seed(20)
        for case in CASES:
            with self.subTest(**case):
                t, h, f, e, k = case["tokens"], case["hidden"], case["ffn"], case["experts"], case["k"]
                x = rng.normal(size=(t, h))
                dout = rng.normal(size=(t, h))
                block, out, aux, dx = reference(case, x, dout)
                got = run_forge(f"{t} {h} {f} {e} {k} 1 {AUX}",
                                dict(x=x, dout=dout, router=block.gate.weight.detach().numpy(),
                                     gate_up=block.experts.gate_up_proj.detach().numpy(),
                                     down=block.experts.down_proj.detach().numpy()))
                self.assertLess(relative_error(got("out", (t, h)), out), TOLERANCE)
                self.assertLess(abs(got("aux") - aux) / aux, TOLERANCE)
                self.assertLess(relative_error(got("dx", (t, h)), dx), TOLERANCE)
                self.assertLess(relative_error(got("d_router", (e, h)), block.gate.weight.grad.numpy()), TOLERANCE)
                self.assertLess(relative_error(got("d_gate_up", (e, 2 * f, h)),
                                               block.experts.gate_up_proj.grad.numpy()), TOLERANCE)
                self.assertLess(relative_error(got("d_down", (e, h, f)), block.experts.down_proj.grad.numpy()),
                                TOLERANCE)


    def check_routed_block(self, got, case, block, x, out):
        """forge's output and gradients against a DeepSeek block's after its backward."""
        t, h, f, e = case["tokens"], case["hidden"], case["ffn"], case["experts"]
        self.assertLess(relative_error(got("out", (t, h)), out.detach().numpy()), TOLERANCE)
        self.assertLess(relative_error(got("dx", (t, h)), x.grad.numpy()), TOLERANCE)
        self.assertLess(relative_error(got("d_router", (e, h)), block.gate.weight.grad.numpy()), TOLERANCE)
        self.assertLess(relative_error(got("d_gate_up", (e, 2 * f, h)), block.experts.gate_up_proj.grad.numpy()),
                        TOLERANCE)
        self.assertLess(relative_error(got("d_down", (e, h, f)), block.experts.down_proj.grad.numpy()), TOLERANCE)

    def test_deepseek_v3_routing(self):
        rng = np.random.RandomState(21)
        torch.manual_seed(21)
        for case in DEEPSEEK_CASES:
            with self.subTest(**case):
                t, h, f, e, k = case["tokens"], case["hidden"], case["ffn"], case["experts"], case["k"]
                block = DeepseekMoe(case).double()
                x, dout, out = random_block_step(block, rng, t, h, routing_bias=True)
                got = run_forge(f"{t} {h} {f} {e} {k} {int(case['normalize'])} 0 "
                                f"{case['groups']} {case['topk_groups']} {case['scaling']}",
                                dict(x=x.detach().numpy(), dout=dout, router=block.gate.weight.detach().numpy(),
                                     bias=block.gate.e_score_correction_bias.numpy(),
                                     gate_up=block.experts.gate_up_proj.detach().numpy(),
                                     down=block.experts.down_proj.detach().numpy()))
                self.check_routed_block(got, case, block, x, out)

    def test_deepseek_v2_routing(self):
        rng = np.random.RandomState(22)
        torch.manual_seed(22)
        for case in DEEPSEEK_V2_CASES:
            with self.subTest(**case):
                t, h, f, e, k = case["tokens"], case["hidden"], case["ffn"], case["experts"], case["k"]
                block = DeepseekV2RoutedMoe(case).double()
                x, dout, out = random_block_step(block, rng, t, h)
                got = run_forge(f"{t} {h} {f} {e} {k} 0 0 {case['groups']} {case['topk_groups']} {case['scaling']} "
                                "softmax",
                                dict(x=x.detach().numpy(), dout=dout, router=block.gate.weight.detach().numpy(),
                                     gate_up=block.experts.gate_up_proj.detach().numpy(),
                                     down=block.experts.down_proj.detach().numpy()))
                self.check_routed_block(got, case, block, x, out)


if __name__ == "__main__":
    unittest.main()
