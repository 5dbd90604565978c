"""The CPU FLUX transformer against diffusers' FluxTransformer2DModel in float64 on tiny
random configs: the predicted velocity and the gradient of every parameter (of
sum(velocity * dout) for a random dout) must agree within 1e-4 relative error. Covers the
guidance embedder on (FLUX.1-dev) and off (FLUX.1-schnell), other head counts and rotary
axis splits, only double-stream or only single-stream blocks, an output width other than
the input's, batches of several samples with their own times, and full activation
checkpointing. Every parameter is drawn at random (biases and norm scales too), so none
hides behind an initialization of 0 or 1."""
import json
import os
import unittest

import numpy as np
import torch
from diffusers import FluxTransformer2DModel

from forge_test_util import relative_error, run, scratch_dir, tool

TOLERANCE = 1e-4

BASE = dict(in_channels=16, out_channels=0, num_heads=2, head_dim=16, axes_dim=[4, 6, 6], num_double_blocks=2,
            num_single_blocks=2, context_dim=24, pooled_dim=12, guidance_embeds=True, batch=2, text_tokens=5,
            grid_h=3, grid_w=4)


def case(name, **overrides):
    c = dict(BASE, name=name)
    c.update(overrides)
    return c


CASES = [
    case("dev_like"),
    case("schnell_like", guidance_embeds=False, batch=1, text_tokens=7, grid_h=2, grid_w=5),
    case("three_heads_out_channels", num_heads=3, head_dim=12, axes_dim=[2, 4, 6], out_channels=8, in_channels=12,
         batch=3, text_tokens=2, grid_h=4, grid_w=2),
    case("double_only", num_single_blocks=0, num_double_blocks=3),
    case("single_only", num_double_blocks=0, num_single_blocks=3, guidance_embeds=False),
    case("full_checkpointing", checkpoint="full", grid_h=2, grid_w=3),
]


def diffusers_model(c):
    torch.manual_seed(len(c["name"]))
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=c["in_channels"], out_channels=c["out_channels"] or None,
        num_layers=c["num_double_blocks"], num_single_layers=c["num_single_blocks"],
        attention_head_dim=c["head_dim"], num_attention_heads=c["num_heads"], joint_attention_dim=c["context_dim"],
        pooled_projection_dim=c["pooled_dim"], guidance_embeds=c["guidance_embeds"],
        axes_dims_rope=tuple(c["axes_dim"])).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.7 / p.shape[1] ** 0.5)
            elif "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    return model


def image_ids(grid_h, grid_w):
    ids = torch.zeros(grid_h, grid_w, 3, dtype=torch.float64)
    ids[..., 1] += torch.arange(grid_h, dtype=torch.float64)[:, None]
    ids[..., 2] += torch.arange(grid_w, dtype=torch.float64)[None, :]
    return ids.reshape(grid_h * grid_w, 3)


class FluxVsDiffusers(unittest.TestCase):
    def check(self, c):
        d = scratch_dir()
        rng = np.random.RandomState(7)
        b, l, s = c["batch"], c["text_tokens"], c["grid_h"] * c["grid_w"]
        out_channels = c["out_channels"] or c["in_channels"]
        config = {k: v for k, v in c.items() if k != "name"}
        # fp32 values, which forge reads; the features of t x 1000 are sin/cos of angles up to
        # 1000 x guidance, where an ulp of fp32 is 1e-4 of a turn: a guidance of 1 to 2 keeps
        # fp32's rounding of the frequencies (which both compute in fp32) below the tolerance.
        config["timesteps"] = [float(np.float32(t)) for t in rng.uniform(0.0, 1.0, b)]
        config["guidance"] = [float(np.float32(g)) for g in rng.uniform(1.0, 2.0, b)]
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        run([tool("forge_flux_reference"), "specs", d])
        with open(os.path.join(d, "specs.json")) as f:
            specs = json.load(f)

        model = diffusers_model(c)
        params = dict(model.named_parameters())
        forge_names = set()
        for spec in specs:
            for name, _ in spec["hf"]:
                forge_names.add(name)
        self.assertEqual(forge_names, set(params), "forge's parameters must be exactly diffusers'")

        def stacked(spec, tensors):
            return torch.cat([tensors[name].reshape(rows, -1) for name, rows in spec["hf"]]).reshape(spec["shape"])

        weights = np.concatenate([stacked(s, params).detach().numpy().ravel() for s in specs]).astype(np.float32)
        # The reference runs on the fp32 values forge reads.
        with torch.no_grad():
            offset = 0
            for spec in specs:
                n = int(np.prod(spec["shape"]))
                values = torch.from_numpy(weights[offset:offset + n].astype(np.float64)).reshape(spec["shape"])
                pieces = torch.split(values, [rows for _, rows in spec["hf"]], dim=0)
                for (name, _), piece in zip(spec["hf"], pieces):
                    params[name].copy_(piece.reshape(params[name].shape))
                offset += n
        weights.tofile(os.path.join(d, "weights.bin"))

        def draw(shape, name):
            x = rng.standard_normal(shape).astype(np.float32)
            x.tofile(os.path.join(d, name))
            return torch.from_numpy(x.astype(np.float64))

        image = draw((b, s, c["in_channels"]), "image.bin")
        text = draw((b, l, c["context_dim"]), "text.bin")
        pooled = draw((b, c["pooled_dim"]), "pooled.bin")
        dout = draw((b, s, out_channels), "dout.bin")

        run([tool("forge_flux_reference"), "run", d])
        out = np.fromfile(os.path.join(d, "out.bin"), dtype=np.float32).reshape(b, s, out_channels)
        grads = np.fromfile(os.path.join(d, "grads.bin"), dtype=np.float32)

        timesteps = torch.tensor(config["timesteps"], dtype=torch.float64)
        guidance = torch.tensor(config["guidance"], dtype=torch.float64) if c["guidance_embeds"] else None
        expected = model(hidden_states=image, encoder_hidden_states=text, pooled_projections=pooled,
                         timestep=timesteps, img_ids=image_ids(c["grid_h"], c["grid_w"]),
                         txt_ids=torch.zeros(l, 3, dtype=torch.float64), guidance=guidance).sample
        (expected * dout).sum().backward()

        self.assertLess(relative_error(out, expected.detach().numpy()), TOLERANCE, "velocity")
        offset = 0
        for spec in specs:
            n = int(np.prod(spec["shape"]))
            actual = grads[offset:offset + n].reshape(spec["shape"])
            offset += n
            # Without single blocks the last double block's text output is unused: diffusers
            # leaves those parameters' gradients unset, forge's are 0.
            want = stacked(spec, {k: p.grad if p.grad is not None else torch.zeros_like(p)
                                  for k, p in params.items()}).numpy()
            self.assertLess(relative_error(actual, want), TOLERANCE, f"gradient of {spec['name']}")

    def test_cases(self):
        for c in CASES:
            with self.subTest(c["name"]):
                self.check(c)


if __name__ == "__main__":
    unittest.main()
