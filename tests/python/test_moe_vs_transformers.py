"""forge's MoE feed-forward ops (ops/moe.h: routing, permutation, per-expert SwiGLU GEMMs,
combine, balancing loss) against transformers' MixtralSparseMoeBlock and
load_balancing_loss_func in float64, on tiny random configs (several expert counts and
top-k, experts left without tokens): the block's output, the balancing loss, and the
gradients of sum(out * dout) + coefficient * loss with respect to the input, the router and
every expert's weights, within 1e-4 relative (forge computes in fp32; transformers' router
takes its softmax in fp32 too)."""
import os
import unittest

import numpy as np
import torch
import torch.nn.functional as F
from transformers import MixtralConfig
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
                d = scratch_dir()
                with open(os.path.join(d, "shape"), "w") as s:
                    s.write(f"{t} {h} {f} {e} {k} 1 {AUX}\n")
                arrays = dict(x=x, dout=dout, router=block.gate.weight.detach().numpy(),
                              gate_up=block.experts.gate_up_proj.detach().numpy(),
                              down=block.experts.down_proj.detach().numpy())
                for name, value in arrays.items():
                    value.astype(np.float32).tofile(os.path.join(d, name))
                run([tool("forge_moe_reference"), d])

                def got(name, shape):
                    return np.fromfile(os.path.join(d, name), dtype=np.float32).astype(np.float64).reshape(shape)

                self.assertLess(relative_error(got("out", (t, h)), out), TOLERANCE)
                with open(os.path.join(d, "aux")) as a:
                    self.assertLess(abs(float(a.read()) - aux) / aux, TOLERANCE)
                self.assertLess(relative_error(got("dx", (t, h)), dx), TOLERANCE)
                self.assertLess(relative_error(got("d_router", (e, h)), block.gate.weight.grad.numpy()), TOLERANCE)
                self.assertLess(relative_error(got("d_gate_up", (e, 2 * f, h)),
                                               block.experts.gate_up_proj.grad.numpy()), TOLERANCE)
                self.assertLess(relative_error(got("d_down", (e, h, f)), block.experts.down_proj.grad.numpy()),
                                TOLERANCE)


if __name__ == "__main__":
    unittest.main()
