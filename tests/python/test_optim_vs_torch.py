"""forge's optimizer layer against PyTorch.

forge_optim_trace runs global_grad_norm + AdamW (clip coefficient applied inside) + lr_at on a scripted problem; the same
problem is replayed with torch.nn.utils.clip_grad_norm_, torch.optim.AdamW(foreach=False)
and torch.optim.lr_scheduler (the composition in NOTE [LR schedule], optim/optimizer.h).
"""

import json
import math
import os
import subprocess
import tempfile
import unittest

import numpy as np
import torch

TOOL = os.path.join(os.environ.get("FORGE_TOOLS_DIR", "build/tests"), "forge_optim_trace")


def run_forge(problem):
    with tempfile.TemporaryDirectory() as tmp:
        in_path, out_path = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
        with open(in_path, "w") as f:
            json.dump(problem, f)
        subprocess.run([TOOL, in_path, out_path], check=True)
        with open(out_path) as f:
            return json.load(f)


def torch_scheduler(optimizer, opt, sched, total_steps):
    peak, warmup = opt["lr"], sched["warmup_steps"]
    decay_steps = sched["decay_steps"] or total_steps - warmup
    lr_scheduler = torch.optim.lr_scheduler
    stages, milestones = [], []
    if warmup > 0:
        stages.append(lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / (warmup + 1)))
        milestones.append(warmup)
    style = sched["decay_style"]
    if style == "constant":
        stages.append(lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
    else:
        if style == "cosine":
            stages.append(lr_scheduler.CosineAnnealingLR(optimizer, T_max=decay_steps, eta_min=sched["min_lr"]))
        else:
            stages.append(lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=sched["min_lr"] / peak,
                                                total_iters=decay_steps))
        stages.append(lr_scheduler.LambdaLR(optimizer, lambda step: sched["min_lr"] / peak))
        milestones.append(warmup + decay_steps)
    return lr_scheduler.SequentialLR(optimizer, stages, milestones)


def run_torch(problem):
    opt, sched = problem["optimizer"], problem["lr_scheduler"]
    total_steps = problem["total_steps"]
    params = [torch.tensor(p["values"], dtype=torch.float32).reshape(p["shape"]).requires_grad_()
              for p in problem["params"]]
    if not params:
        params = [torch.zeros(1, requires_grad=True)]
    decay = [p for p, spec in zip(params, problem["params"]) if spec["decay"]]
    no_decay = [p for p, spec in zip(params, problem["params"]) if not spec["decay"]]
    groups = [{"params": decay, "weight_decay": opt["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]] or [{"params": params}], lr=opt["lr"],
                                  betas=(opt["beta1"], opt["beta2"]), eps=opt["eps"], foreach=False)
    scheduler = torch_scheduler(optimizer, opt, sched, total_steps)

    max_norm = problem["max_norm"] if problem["max_norm"] > 0 else math.inf
    lrs, norms = [], []
    for step in range(total_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        if step < len(problem["grads"]):
            for p, g in zip(params, problem["grads"][step]):
                p.grad = torch.tensor(g, dtype=torch.float32).reshape(p.shape)
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)))
        optimizer.step()
        scheduler.step()
    state = [optimizer.state[p] for p in params if p.grad is not None]
    return {
        "lrs": lrs,
        "norms": norms,
        "params": [p.detach().flatten().tolist() for p in params],
        "exp_avg": [s["exp_avg"].flatten().tolist() for s in state],
        "exp_avg_sq": [s["exp_avg_sq"].flatten().tolist() for s in state],
    }


def max_relative_error(ours, reference, floor):
    ours, reference = np.asarray(ours, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    return float(np.max(np.abs(ours - reference) / np.maximum(np.abs(reference), floor)))


def make_problem(seed, decay_style, warmup_steps, decay_steps, min_lr, max_norm, beta1=0.9, steps=12,
                 grad_steps=None):
    rng = np.random.default_rng(seed)
    shapes = [([4, 9], True), ([37], False), ([3, 5, 7], True), ([2], False), ([50, 41], True)]
    params = [{"shape": shape, "decay": decay,
               "values": rng.standard_normal(int(np.prod(shape))).astype(np.float32).tolist()}
              for shape, decay in shapes]
    grads = []
    for step in range(steps if grad_steps is None else grad_steps):
        scale = 3.0 if step % 3 == 0 else 0.005  # some steps clip, some do not
        grads.append([(scale * rng.standard_normal(int(np.prod(s)))).astype(np.float32).tolist() for s, _ in shapes])
    return {
        "optimizer": {"lr": 3e-3, "beta1": beta1, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1},
        "lr_scheduler": {"warmup_steps": warmup_steps, "decay_style": decay_style, "decay_steps": decay_steps,
                         "min_lr": min_lr},
        "total_steps": steps,
        "max_norm": max_norm,
        "params": params,
        "grads": grads,
    }


class OptimizerVsTorch(unittest.TestCase):
    def compare_lrs(self, ours, reference, label):
        err = max_relative_error(ours["lrs"], reference["lrs"], floor=1e-300)
        print(f"{label}: lrs over {len(ours['lrs'])} steps, max rel err {err:.2e}")
        self.assertEqual(len(ours["lrs"]), len(reference["lrs"]))
        self.assertLess(err, 1e-12, label)

    def test_schedules(self):
        for style in ("cosine", "linear", "constant"):
            for warmup in (0, 7):
                for decay_steps, min_lr in ((0, 0.0), (25, 3e-4)):
                    label = f"{style} warmup={warmup} decay_steps={decay_steps} min_lr={min_lr}"
                    with self.subTest(label):
                        problem = make_problem(0, style, warmup, decay_steps, min_lr, 1.0, steps=60, grad_steps=0)
                        problem["params"] = []
                        self.compare_lrs(run_forge(problem), run_torch(problem), label)

    def test_adamw_with_clipping(self):
        cases = [
            ("cosine", 3, 0, 0.0, 1.0, 0.9),
            ("linear", 0, 8, 1e-4, 1.0, 0.9),
            ("constant", 2, 0, 0.0, 0.0, 0.3),  # no clipping; beta1 < 0.5 takes lerp's other branch
        ]
        for seed, (style, warmup, decay_steps, min_lr, max_norm, beta1) in enumerate(cases):
            label = f"{style} warmup={warmup} max_norm={max_norm} beta1={beta1}"
            with self.subTest(label):
                problem = make_problem(seed, style, warmup, decay_steps, min_lr, max_norm, beta1=beta1)
                ours, reference = run_forge(problem), run_torch(problem)
                self.compare_lrs(ours, reference, label)
                norm_err = max_relative_error(ours["norms"], reference["norms"], floor=1e-30)
                clipped = sum(n > max_norm for n in reference["norms"]) if max_norm > 0 else 0
                print(f"{label}: norms max rel err {norm_err:.2e} ({clipped} of {len(ours['norms'])} steps clipped)")
                self.assertLess(norm_err, 1e-6, label)
                for key in ("params", "exp_avg", "exp_avg_sq"):
                    # Relative to each tensor's largest element: an element near zero (a
                    # moment that changed sign) carries the absolute error of its neighbours.
                    err = max(float(np.max(np.abs(np.subtract(a, b)) / np.max(np.abs(b))))
                              for a, b in zip(ours[key], reference[key]))
                    ours_flat = np.concatenate(ours[key]).astype(np.float32)
                    ref_flat = np.concatenate(reference[key]).astype(np.float32)
                    ulps = np.abs(ours_flat.view(np.int32).astype(np.int64) - ref_flat.view(np.int32).astype(np.int64))
                    print(f"{label}: {key} ({ulps.size} values) max rel err {err:.2e}, "
                          f"{np.count_nonzero(ulps)} differ, by at most {ulps.max()} ulp")
                    self.assertLess(err, 1e-6, f"{label}: {key}")


if __name__ == "__main__":
    unittest.main()
