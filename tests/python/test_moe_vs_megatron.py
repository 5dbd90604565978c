"""forge's per-layer and sequence-wise balancing losses and router z-loss (ops/moe.h:
moe_grouped_balancing_loss, moe_z_loss, moe_route_backward's [groups, experts] probability
gradient and z-loss term) against megatron-core 0.16's own functions in float64:
switch_load_balancing_loss_func (called as TopKRouter._apply_aux_loss and
_apply_seq_aux_loss call it, the sequence form on Megatron's [seq, batch] token order),
z_loss_func, and MoEAuxLossAutoScaler, which attaches each loss to the router's activations
so that its gradient (scale 1, one micro-batch) flows into the router as in Megatron. The
MoE layer around them (softmax top-k routing with the chosen probabilities renormalized,
SwiGLU experts, out = x + sum_j w_j expert_j(x)) is written here in torch; one layer and
several layers applied in turn, several expert counts and top-k, one and several sequences.
The output, each loss, and the gradients of sum(out * dout) + the coefficients x the losses
with respect to the input, every router and every expert's weights must agree within 1e-4
relative (forge computes in fp32); a case with dout = 0 leaves only the losses' gradients in
the routers.

Token dropping (NOTE [MoE capacity]) against Megatron's own routing: topk_routing_with_score_function
and apply_router_token_dropping, capacity factors 0.5, 0.75, 1.0 and 1.25, policies probs and
position, with and without padding to capacity. The kept map (Megatron's final map and its routing
map), the kept probabilities, the layer's output, its balancing loss (Megatron's takes its routing
map before the drop) and every gradient must agree. Megatron's position policy takes torch.topk of
the 0/1 routing map, whose ties torch leaves unordered (on the CPU it keeps other than the first
assignments); its documentation says the tokens at the end are dropped, which forge does, so the
test runs Megatron's function with torch.topk ranking equal values in index order.

The global balancing loss (model.router_aux_loss_type global) against TopKRouter's own
_apply_global_aux_loss and reset_global_aux_loss_tracker, over several simulated
data-parallel ranks, the micro-batches of a step and the steps: TopKRouter itself makes its
buffers on CUDA and wants Megatron's process groups, so its methods run on a stand-in holding
what they read (config, top-k, the step's counts in float64), and the all-reduce of the tokens
per expert (moe_utils.reduce_from_tensor_model_parallel_region) returns the sum over the
simulated ranks' routing maps. Each rank's micro-batch's loss (Megatron's own logging of it)
and gradients must agree with forge's, the reset between steps included."""
import os
import unittest
import warnings
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_utils import (MoEAuxLossAutoScaler, apply_router_token_dropping,
                                                         compute_routing_scores_for_aux_loss,
                                                         switch_load_balancing_loss_func,
                                                         topk_routing_with_score_function, z_loss_func)
    from megatron.core.transformer.moe.router import TopKRouter

from forge_test_util import relative_error, run, scratch_dir, tool

TOLERANCE = 1e-4

CASES = [
    # sequences: the micro-batch's rows (tokens = sequences x seq).
    dict(sequences=1, seq=9, hidden=8, ffn=12, experts=4, k=2, layers=1, aux_type="per_layer", aux=0.3, z=0.0),
    dict(sequences=1, seq=12, hidden=8, ffn=8, experts=8, k=2, layers=1, aux_type="per_layer", aux=0.0, z=0.2),
    dict(sequences=1, seq=16, hidden=16, ffn=24, experts=8, k=3, layers=3, aux_type="per_layer", aux=0.5, z=0.1),
    dict(sequences=3, seq=5, hidden=12, ffn=8, experts=6, k=1, layers=1, aux_type="sequence", aux=0.4, z=0.0),
    dict(sequences=2, seq=7, hidden=8, ffn=16, experts=8, k=2, layers=2, aux_type="sequence", aux=0.6, z=0.05),
    dict(sequences=4, seq=3, hidden=8, ffn=8, experts=16, k=4, layers=2, aux_type="sequence", aux=1.0, z=0.3),
    dict(sequences=2, seq=6, hidden=8, ffn=8, experts=8, k=2, layers=2, aux_type="sequence", aux=0.7, z=0.2,
         zero_dout=True),
]


def megatron_block(case, x, routers, gate_ups, downs):
    """The layers in torch with Megatron's losses attached; returns out and the losses."""
    b, s, e, k = case["sequences"], case["seq"], case["experts"], case["k"]
    aux_total = torch.zeros((), dtype=torch.float64)
    z_total = torch.zeros((), dtype=torch.float64)
    h = x
    for router, gate_up, down in zip(routers, gate_ups, downs):
        logits = F.linear(h, router)  # [tokens, experts], forge's [batch, seq] order
        if case["z"] > 0:  # as TopKRouter.apply_z_loss
            z = z_loss_func(logits, case["z"])
            logits = MoEAuxLossAutoScaler.apply(logits, z)
            z_total = z_total + z.detach() / case["z"]
        probs = torch.softmax(logits, dim=-1)
        top, ids = torch.topk(probs, k, dim=-1)
        weights = top / top.sum(dim=-1, keepdim=True)
        routing_map = torch.zeros_like(probs, dtype=torch.bool).scatter(1, ids, True)
        scores = torch.softmax(logits, dim=-1)  # scores_for_aux_loss
        if case["aux_type"] == "per_layer":  # as TopKRouter._apply_aux_loss
            aux = switch_load_balancing_loss_func(probs=scores, tokens_per_expert=routing_map.sum(dim=0),
                                                  total_num_tokens=routing_map.shape[0], topk=k, num_experts=e,
                                                  moe_aux_loss_coeff=case["aux"])
        else:  # as TopKRouter._apply_seq_aux_loss, on Megatron's [seq, batch] token order
            seq_major = lambda t: t.view(b, s, e).transpose(0, 1).reshape(s, -1)
            scores_sb, map_sb = seq_major(scores), seq_major(routing_map)
            aux = switch_load_balancing_loss_func(probs=scores_sb, tokens_per_expert=map_sb.sum(dim=0),
                                                  total_num_tokens=map_sb.shape[0], topk=k, num_experts=e,
                                                  moe_aux_loss_coeff=case["aux"]) / b
        if case["aux"] > 0:
            weights = MoEAuxLossAutoScaler.apply(weights, aux)
            aux_total = aux_total + aux.detach() / case["aux"]
        out = h.clone()
        for j in range(k):
            g, u = gate_up[ids[:, j]].split(case["ffn"], dim=1)  # [tokens, F, H]
            act = F.silu(torch.einsum("th,tfh->tf", h, g)) * torch.einsum("th,tfh->tf", h, u)
            out = out + weights[:, j:j + 1] * torch.einsum("tf,thf->th", act, down[ids[:, j]])
        h = out
    return h, float(aux_total), float(z_total)


# Megatron applies the router z-loss to the logits whatever the score function: sigmoid
# routing (DeepSeek-V3's scores, renormalized, scaled), no balancing loss.
SIGMOID_Z_CASES = [
    dict(sequences=1, seq=10, hidden=8, ffn=8, experts=8, k=2, layers=1, z=0.2, scaling=2.5),
    dict(sequences=2, seq=6, hidden=12, ffn=8, experts=16, k=4, layers=2, z=0.05, scaling=1.0),
]


def megatron_sigmoid_block(case, x, routers, gate_ups, downs):
    """The layers with Megatron's sigmoid routing and z-loss; returns out and the z-losses."""
    z_total = torch.zeros((), dtype=torch.float64)
    h = x
    for router, gate_up, down in zip(routers, gate_ups, downs):
        logits = F.linear(h, router)
        z = z_loss_func(logits, case["z"])  # as TopKRouter.apply_z_loss
        logits = MoEAuxLossAutoScaler.apply(logits, z)
        z_total = z_total + z.detach() / case["z"]
        probs, routing_map = topk_routing_with_score_function(logits, case["k"], score_function="sigmoid",
                                                              scaling_factor=case["scaling"])
        out = h.clone()
        for e in range(case["experts"]):
            g, u = gate_up[e].split(case["ffn"], dim=0)
            act = F.silu(h @ g.T) * (h @ u.T)
            out = out + probs[:, e:e + 1] * (act @ down[e].T) * routing_map[:, e:e + 1]
        h = out
    return h, float(z_total)


CAPACITY_CASES = [
    dict(sequences=1, seq=16, hidden=8, ffn=8, experts=4, k=2, layers=1, aux_type="per_layer", aux=0.0, z=0.0,
         capacity=factor, policy=policy, pad=pad)
    for factor in (0.5, 1.0, 1.25) for policy in ("probs", "position") for pad in (False, True)
] + [
    dict(sequences=1, seq=24, hidden=8, ffn=12, experts=8, k=2, layers=2, aux_type="per_layer", aux=0.4, z=0.0,
         capacity=1.0, policy="probs", pad=False),
    dict(sequences=1, seq=24, hidden=8, ffn=12, experts=8, k=3, layers=1, aux_type="per_layer", aux=0.3, z=0.0,
         capacity=0.75, policy="position", pad=True),
]


def stable_topk(values, k, dim, sorted=True):
    """torch.topk with equal values ranked by index (what Megatron's position policy means)."""
    order = torch.argsort(values, dim=dim, descending=True, stable=True).narrow(dim, 0, k)
    return torch.gather(values, dim, order), order


def megatron_capacity_block(case, x, routers, gate_ups, downs):
    """The layers with Megatron's routing and token dropping; returns out, the per-layer
    balancing losses (on the routing map before the drop, as TopKRouter.routing), the kept
    maps and the kept probabilities."""
    e, k = case["experts"], case["k"]
    aux_total = torch.zeros((), dtype=torch.float64)
    kept_maps, kept_probs = [], []
    h = x
    for router, gate_up, down in zip(routers, gate_ups, downs):
        logits = F.linear(h, router)
        probs, routing_map = topk_routing_with_score_function(logits, k, score_function="softmax")
        topk = moe_utils.torch.topk
        if case["policy"] == "position":
            moe_utils.torch.topk = stable_topk
        try:
            probs, final_map = apply_router_token_dropping(probs, routing_map, router_topk=k,
                                                           capacity_factor=case["capacity"],
                                                           drop_policy=case["policy"], pad_to_capacity=case["pad"])
        finally:
            moe_utils.torch.topk = topk
        kept_maps.append((final_map & routing_map).double())
        kept_probs.append(probs.detach().clone())
        if case["aux"] > 0:
            aux_map, scores = compute_routing_scores_for_aux_loss(logits, k, "softmax")
            aux = switch_load_balancing_loss_func(probs=scores, tokens_per_expert=aux_map.sum(dim=0),
                                                  total_num_tokens=aux_map.shape[0], topk=k, num_experts=e,
                                                  moe_aux_loss_coeff=case["aux"])
            probs = MoEAuxLossAutoScaler.apply(probs, aux)
            aux_total = aux_total + aux.detach() / case["aux"]
        out = h.clone()
        for expert in range(e):
            g, u = gate_up[expert].split(case["ffn"], dim=0)
            act = F.silu(h @ g.T) * (h @ u.T)
            out = out + probs[:, expert:expert + 1] * (act @ down[expert].T)
        h = out
    return h, float(aux_total), kept_maps, kept_probs


# The global balancing loss over `ranks` simulated data-parallel ranks, `micro_batches`
# micro-batches per step and `steps` steps (each rank's micro-batches of sequences x seq tokens).
GLOBAL_CASES = [
    dict(ranks=1, micro_batches=3, steps=2, sequences=1, seq=8, hidden=8, ffn=8, experts=4, k=2, layers=1, aux=0.3,
         z=0.0),
    dict(ranks=2, micro_batches=2, steps=2, sequences=2, seq=5, hidden=8, ffn=12, experts=8, k=2, layers=2, aux=0.5,
         z=0.1),
    dict(ranks=3, micro_batches=3, steps=2, sequences=1, seq=6, hidden=8, ffn=8, experts=6, k=3, layers=1, aux=0.7,
         z=0.0, zero_dout=True),
]


class SimulatedRanks:
    """The tp_dp_cp group _apply_global_aux_loss reduces over: its size, and the layer's tokens
    per expert summed over the simulated ranks' routing maps of the micro-batch (`total`), which
    the patched reduce_from_tensor_model_parallel_region returns."""

    def __init__(self, size):
        self._size = size
        self.total = None

    def size(self):
        return self._size


def sum_over_simulated_ranks(local_tokens_per_expert, group):
    assert local_tokens_per_expert.shape == group.total.shape
    return group.total.clone()


class MegatronGlobalRouter:
    """What TopKRouter's global-aux-loss methods read of the router module, which makes its
    buffers on CUDA: they run here as Megatron wrote them, on float64 counts."""
    get_aux_loss_coeff = TopKRouter.get_aux_loss_coeff
    attach_and_log_load_balancing_loss = TopKRouter.attach_and_log_load_balancing_loss
    apply_global_aux_loss = TopKRouter._apply_global_aux_loss
    reset_global_aux_loss_tracker = TopKRouter.reset_global_aux_loss_tracker

    def __init__(self, case, layer, group):
        self.config = type("Config", (), dict(moe_aux_loss_coeff=case["aux"], num_moe_experts=case["experts"],
                                              moe_router_fusion=False, num_layers=case["layers"],
                                              mtp_num_layers=None))()
        self.routing_type = "global_aux_loss"
        self.topk = case["k"]
        self.layer_number = layer + 1
        self.calculate_per_token_loss = False
        self.tp_dp_cp_group = group
        self.global_tokens_per_expert = torch.zeros(case["experts"], dtype=torch.float64)
        self.ga_steps = torch.tensor(0.0, dtype=torch.float64)


def megatron_global_block(case, x, routers, gate_ups, downs, global_routers=None):
    """The layers with softmax top-k routing; with global_routers (one per layer) each layer's
    global balancing loss attached as TopKRouter.routing attaches it. Returns out, the z-losses
    and each layer's map of compute_routing_scores_for_aux_loss (what the loss counts)."""
    e, k = case["experts"], case["k"]
    z_total = torch.zeros((), dtype=torch.float64)
    aux_maps = []
    h = x
    for layer, (router, gate_up, down) in enumerate(zip(routers, gate_ups, downs)):
        logits = F.linear(h, router)
        if case["z"] > 0:
            z = z_loss_func(logits, case["z"])
            logits = MoEAuxLossAutoScaler.apply(logits, z)
            z_total = z_total + z.detach() / case["z"]
        probs = torch.softmax(logits, dim=-1)
        top, ids = torch.topk(probs, k, dim=-1)
        weights = top / top.sum(dim=-1, keepdim=True)
        aux_map, scores = compute_routing_scores_for_aux_loss(logits, k, "softmax")
        aux_maps.append(aux_map)
        if global_routers is not None:
            weights = global_routers[layer].apply_global_aux_loss(weights, scores, aux_map)
        out = h.clone()
        for j in range(k):
            g, u = gate_up[ids[:, j]].split(case["ffn"], dim=1)
            act = F.silu(torch.einsum("th,tfh->tf", h, g)) * torch.einsum("th,tfh->tf", h, u)
            out = out + weights[:, j:j + 1] * torch.einsum("tf,thf->th", act, down[ids[:, j]])
        h = out
    return h, float(z_total), aux_maps


def run_forge(case, x, dout, routers, gate_ups, downs):
    """forge_moe_reference on the case; with case["scaling"], sigmoid routing (groups 1 of 1, no
    routing bias) scaled by it."""
    d = scratch_dir()
    t = case["sequences"] * case["seq"]
    sigmoid = "scaling" in case
    with open(os.path.join(d, "shape"), "w") as f:
        f.write(f"{t} {case['hidden']} {case['ffn']} {case['experts']} {case['k']} 1 {case['aux']}"
                + (f" 1 1 {case['scaling']}" if sigmoid else "") + "\n")
    if sigmoid:
        np.zeros(case["experts"], dtype=np.float32).tofile(os.path.join(d, "bias"))
    with open(os.path.join(d, "losses"), "w") as f:
        f.write(f"{case['layers']} {case['aux_type']} {case['z']} {case['sequences']}\n")
    if case.get("capacity"):
        with open(os.path.join(d, "capacity"), "w") as f:
            f.write(f"{case['capacity']} {case['policy']} {int(case['pad'])}\n")
    if case["aux_type"] == "global":
        with open(os.path.join(d, "global"), "w") as f:
            f.write(f"{case['ranks']} {case['micro_batches']} {case['steps']}\n")
    for name, value in dict(x=x, dout=dout, router=np.stack(routers), gate_up=np.stack(gate_ups),
                            down=np.stack(downs)).items():
        value.astype(np.float32).tofile(os.path.join(d, name))
    run([tool("forge_moe_reference"), d])

    def got(name, shape=None):
        if name in ("aux", "z"):  # a line per input (several with the global loss's micro-batches)
            with open(os.path.join(d, name)) as f:
                values = [float(line) for line in f.read().split()]
            return values if case["aux_type"] == "global" else values[0]
        return np.fromfile(os.path.join(d, name), dtype=np.float32).astype(np.float64).reshape(shape)

    return got


class MoeVsMegatron(unittest.TestCase):
    def test_cases(self):
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, dtype=torch.float64))
        rng = np.random.RandomState(16)
        for case in CASES:
            with self.subTest(**case):
                b, s, h, f, e, n = (case["sequences"], case["seq"], case["hidden"], case["ffn"], case["experts"],
                                    case["layers"])
                t = b * s
                x = rng.normal(size=(t, h))
                dout = np.zeros((t, h)) if case.get("zero_dout") else rng.normal(size=(t, h))
                routers = [rng.normal(0.0, 0.7, size=(e, h)) for _ in range(n)]
                gate_ups = [rng.normal(0.0, 0.25, size=(e, 2 * f, h)) for _ in range(n)]
                downs = [rng.normal(0.0, 0.25, size=(e, h, f)) for _ in range(n)]
                leaf = lambda a: torch.tensor(a, dtype=torch.float64, requires_grad=True)
                xt, rt, gt, dt = leaf(x), [leaf(a) for a in routers], [leaf(a) for a in gate_ups], [
                    leaf(a) for a in downs]
                out, aux, z = megatron_block(case, xt, rt, gt, dt)
                (out * torch.tensor(dout, dtype=torch.float64)).sum().backward()
                got = run_forge(case, x, dout, routers, gate_ups, downs)
                self.assertLess(relative_error(got("out", (t, h)), out.detach().numpy()), TOLERANCE)
                if case["aux"] > 0:
                    self.assertLess(abs(got("aux") - aux) / aux, TOLERANCE)
                if case["z"] > 0:
                    self.assertLess(abs(got("z") - z) / z, TOLERANCE)
                self.assertLess(relative_error(got("dx", (t, h)), xt.grad.numpy()), TOLERANCE)
                d_router = got("d_router", (n, e, h))
                d_gate_up = got("d_gate_up", (n, e, 2 * f, h))
                d_down = got("d_down", (n, e, h, f))
                for layer in range(n):
                    self.assertGreater(float(abs(rt[layer].grad).max()), 0.0)
                    self.assertLess(relative_error(d_router[layer], rt[layer].grad.numpy()), TOLERANCE)
                    self.assertLess(relative_error(d_gate_up[layer], gt[layer].grad.numpy()), TOLERANCE)
                    self.assertLess(relative_error(d_down[layer], dt[layer].grad.numpy()), TOLERANCE)

    def test_z_loss_with_sigmoid_routing(self):
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, dtype=torch.float64))
        rng = np.random.RandomState(19)
        for case in SIGMOID_Z_CASES:
            with self.subTest(**case):
                b, s, h, f, e, n = (case["sequences"], case["seq"], case["hidden"], case["ffn"], case["experts"],
                                    case["layers"])
                t = b * s
                x = rng.normal(size=(t, h))
                dout = rng.normal(size=(t, h))
                routers = [rng.normal(0.0, 0.7, size=(e, h)) for _ in range(n)]
                gate_ups = [rng.normal(0.0, 0.25, size=(e, 2 * f, h)) for _ in range(n)]
                downs = [rng.normal(0.0, 0.25, size=(e, h, f)) for _ in range(n)]
                leaf = lambda a: torch.tensor(a, dtype=torch.float64, requires_grad=True)
                xt, rt, gt, dt = leaf(x), [leaf(a) for a in routers], [leaf(a) for a in gate_ups], [
                    leaf(a) for a in downs]
                out, z = megatron_sigmoid_block(case, xt, rt, gt, dt)
                (out * torch.tensor(dout, dtype=torch.float64)).sum().backward()
                got = run_forge(dict(case, aux=0.0, aux_type="per_layer"), x, dout, routers, gate_ups, downs)
                self.assertLess(abs(got("z") - z) / z, TOLERANCE)
                self.assertLess(relative_error(got("out", (t, h)), out.detach().numpy()), TOLERANCE)
                self.assertLess(relative_error(got("dx", (t, h)), xt.grad.numpy()), TOLERANCE)
                d_router = got("d_router", (n, e, h))
                for layer in range(n):
                    self.assertLess(relative_error(d_router[layer], rt[layer].grad.numpy()), TOLERANCE)
                    self.assertLess(relative_error(got("d_gate_up", (n, e, 2 * f, h))[layer],
                                                   gt[layer].grad.numpy()), TOLERANCE)

    def test_token_dropping(self):
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, dtype=torch.float64))
        rng = np.random.RandomState(18)
        dropped = 0
        for case in CAPACITY_CASES:
            with self.subTest(**case):
                t, h, f, e, n = case["seq"], case["hidden"], case["ffn"], case["experts"], case["layers"]
                x = rng.normal(size=(t, h))
                dout = rng.normal(size=(t, h))
                routers = [rng.normal(0.0, 0.7, size=(e, h)) for _ in range(n)]
                for r in routers:  # expert 0 favoured by every token, so that it overflows
                    r[0] += 3.0 * x.mean(axis=0) / np.dot(x.mean(axis=0), x.mean(axis=0))
                gate_ups = [rng.normal(0.0, 0.25, size=(e, 2 * f, h)) for _ in range(n)]
                downs = [rng.normal(0.0, 0.25, size=(e, h, f)) for _ in range(n)]
                leaf = lambda a: torch.tensor(a, dtype=torch.float64, requires_grad=True)
                xt, rt, gt, dt = leaf(x), [leaf(a) for a in routers], [leaf(a) for a in gate_ups], [
                    leaf(a) for a in downs]
                out, aux, kept_maps, kept_probs = megatron_capacity_block(case, xt, rt, gt, dt)
                (out * torch.tensor(dout, dtype=torch.float64)).sum().backward()
                got = run_forge(case, x, dout, routers, gate_ups, downs)
                forge_maps, forge_probs = got("kept_map", (n, t, e)), got("kept_probs", (n, t, e))
                for layer in range(n):
                    np.testing.assert_array_equal(forge_maps[layer], kept_maps[layer].numpy())
                    self.assertLess(relative_error(forge_probs[layer], kept_probs[layer].numpy()), TOLERANCE)
                    dropped += int(t * case["k"] - kept_maps[layer].sum())
                self.assertLess(relative_error(got("out", (t, h)), out.detach().numpy()), TOLERANCE)
                if case["aux"] > 0:
                    self.assertLess(abs(got("aux") - aux) / aux, TOLERANCE)
                self.assertLess(relative_error(got("dx", (t, h)), xt.grad.numpy()), TOLERANCE)
                d_router = got("d_router", (n, e, h))
                d_gate_up = got("d_gate_up", (n, e, 2 * f, h))
                d_down = got("d_down", (n, e, h, f))
                for layer in range(n):
                    self.assertLess(relative_error(d_router[layer], rt[layer].grad.numpy()), TOLERANCE)
                    self.assertLess(relative_error(d_gate_up[layer], gt[layer].grad.numpy()), TOLERANCE)
                    self.assertLess(relative_error(d_down[layer], dt[layer].grad.numpy()), TOLERANCE)
        self.assertGreater(dropped, 0)

    def test_global_balancing_loss(self):
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, dtype=torch.float64))
        rng = np.random.RandomState(20)
        for case in GLOBAL_CASES:
            case = dict(case, aux_type="global")
            with self.subTest(**case):
                r, m, steps, n = case["ranks"], case["micro_batches"], case["steps"], case["layers"]
                t, h, f, e = case["sequences"] * case["seq"], case["hidden"], case["ffn"], case["experts"]
                passes = steps * m * r  # step by step, micro-batch by micro-batch, rank by rank
                x = rng.normal(size=(passes, t, h))
                dout = np.zeros((passes, t, h)) if case.get("zero_dout") else rng.normal(size=(passes, t, h))
                routers = [rng.normal(0.0, 0.7, size=(e, h)) for _ in range(n)]
                gate_ups = [rng.normal(0.0, 0.25, size=(e, 2 * f, h)) for _ in range(n)]
                downs = [rng.normal(0.0, 0.25, size=(e, h, f)) for _ in range(n)]
                as_torch = lambda a: torch.tensor(a, dtype=torch.float64)
                groups = [SimulatedRanks(r) for _ in range(n)]
                megatron = [[MegatronGlobalRouter(case, layer, groups[layer]) for layer in range(n)] for _ in range(r)]
                tracker = moe_utils.get_moe_layer_wise_logging_tracker()
                want_aux, want_z, want_dx, want_router, local_aux = [], [], [], [], []
                with mock.patch.object(moe_utils, "reduce_from_tensor_model_parallel_region",
                                       sum_over_simulated_ranks):
                    for step in range(steps):
                        for rank_routers in megatron:  # as finalize_model_grads after each step
                            for router in rank_routers:
                                router.reset_global_aux_loss_tracker()
                        for micro in range(m):
                            first = (step * m + micro) * r
                            with torch.no_grad():  # every rank's counts, for the simulated all-reduce
                                maps = [megatron_global_block(case, as_torch(x[first + rank]),
                                                              [as_torch(a) for a in routers],
                                                              [as_torch(a) for a in gate_ups],
                                                              [as_torch(a) for a in downs])[2] for rank in range(r)]
                            for layer in range(n):
                                groups[layer].total = sum(mp[layer].sum(dim=0) for mp in maps)
                            for rank in range(r):
                                tracker.clear()
                                leaf = lambda a: torch.tensor(a, dtype=torch.float64, requires_grad=True)
                                xt, rt = leaf(x[first + rank]), [leaf(a) for a in routers]
                                out, z, _ = megatron_global_block(case, xt, rt, [as_torch(a) for a in gate_ups],
                                                                  [as_torch(a) for a in downs], megatron[rank])
                                (out * as_torch(dout[first + rank])).sum().backward()
                                want_aux.append(float(tracker["global_load_balancing_loss"]["values"].sum()))
                                want_z.append(z)
                                want_dx.append(xt.grad.numpy())
                                want_router.append([a.grad.numpy() for a in rt])
                                if n == 1:  # the loss of the micro-batch's counts alone, without the step's
                                    probs = torch.softmax(F.linear(as_torch(x[first + rank]), as_torch(routers[0])), -1)
                                    local_aux.append(float(switch_load_balancing_loss_func(
                                        probs=probs, tokens_per_expert=groups[0].total, total_num_tokens=t * r,
                                        topk=case["k"], num_experts=e, moe_aux_loss_coeff=1.0)))
                got = run_forge(case, x.reshape(passes * t, h), dout.reshape(passes * t, h), routers, gate_ups, downs)
                aux, z = got("aux"), got("z")
                self.assertEqual(len(aux), passes)
                d_router = got("d_router", (passes, n, e, h))
                dx = got("dx", (passes, t, h))
                for p in range(passes):
                    where = f"step {p // (m * r)}, micro-batch {p // r % m}, rank {p % r}"
                    self.assertLess(abs(aux[p] - want_aux[p]) / want_aux[p], TOLERANCE, where)
                    if case["z"] > 0:
                        self.assertLess(abs(z[p] - want_z[p]) / want_z[p], TOLERANCE, where)
                    self.assertLess(relative_error(dx[p], want_dx[p]), TOLERANCE, where)
                    for layer in range(n):
                        self.assertGreater(float(abs(want_router[p][layer]).max()), 0.0)
                        self.assertLess(relative_error(d_router[p][layer], want_router[p][layer]), TOLERANCE,
                                        f"{where}, layer {layer}")
                # A step's later micro-batches take the earlier ones' counts (their loss is not
                # that of their own counts alone); its first, after the reset, does not.
                for p in range(passes if n == 1 else 0):
                    gap = abs(want_aux[p] - local_aux[p]) / want_aux[p]
                    if p // r % m > 0:
                        self.assertGreater(gap, 1e-3)
                    else:
                        self.assertLess(gap, 1e-6)  # Megatron logs the loss in float32

    def test_losses_change_the_router_gradient(self):
        """Each loss's gradient is not lost in the others: without it the routers' gradient differs."""
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, dtype=torch.float64))
        rng = np.random.RandomState(17)
        case = dict(sequences=2, seq=6, hidden=8, ffn=8, experts=8, k=2, layers=1, aux_type="sequence", aux=0.5,
                    z=0.2)
        t, h, f, e = 12, 8, 8, 8
        x, dout = rng.normal(size=(t, h)), rng.normal(size=(t, h))
        router, gate_up, down = rng.normal(0, 0.7, (e, h)), rng.normal(0, 0.4, (e, 2 * f, h)), rng.normal(0, 0.4,
                                                                                                          (e, h, f))
        base = run_forge(case, x, dout, [router], [gate_up], [down])("d_router", (1, e, h))
        for change in (dict(aux=0.0, aux_type="pooled"), dict(z=0.0), dict(aux_type="per_layer")):
            other = run_forge({**case, **change}, x, dout, [router], [gate_up], [down])("d_router", (1, e, h))
            self.assertGreater(relative_error(other, base), 1e-3, change)


if __name__ == "__main__":
    unittest.main()
