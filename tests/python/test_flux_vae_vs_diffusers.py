"""forge's CPU FLUX VAE against diffusers' AutoencoderKL on tiny random configs.

forge computes in float32 on float32 weights and inputs; diffusers runs in float64 on the
same values. Within 1e-4 relative error (max |diff| / max |reference|) must agree: the
encoder's moments (the latent mean and log-variance, diffusers' latent_dist.parameters), the
FLUX-scaled latents of the mode and of a sample with a given noise ((z - shift) * scale, as
FluxPipeline computes them), and the decoder's image of given latents (decode(latents / scale
+ shift)). Every parameter is drawn at random (norm weights and biases too). Cases cover FLUX's
latent width and scaling, three levels with a channel count that repeats (no shortcut
convolution there), layers_per_block 1 and 2, input and output channel counts other than 3,
the quant convolutions on and the mid-block attention off, batches of 2, non-square images.

Also checked: the names and shapes of every tensor forge reads, for FLUX.1-dev's config and the
tiny ones, are exactly diffusers' state dict; BFL's layout is exactly what diffusers' own
converter (convert_ldm_vae_checkpoint) turns into that state dict, values included; and forge
reading a BFL file computes what diffusers computes.
"""
import json
import os
import unittest

import numpy as np
import torch
from diffusers import AutoencoderKL
from flux_fixtures import randomize
from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
from safetensors.torch import save_file

from forge_test_util import relative_error, run, scratch_dir, tool

TOLERANCE = 1e-4

FLUX_DEV_CONFIG = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
    down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4, layers_per_block=2,
    norm_num_groups=32, act_fn="silu", use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611,
    shift_factor=0.1159, mid_block_add_attention=True, sample_size=1024, force_upcast=True, latents_mean=None,
    latents_std=None)


def tiny(levels, **overrides):
    c = dict(FLUX_DEV_CONFIG, down_block_types=["DownEncoderBlock2D"] * levels,
             up_block_types=["UpDecoderBlock2D"] * levels, sample_size=32)
    c.update(overrides)
    return c


CASES = [
    ("flux_like", tiny(2, block_out_channels=[8, 16], norm_num_groups=4), dict(batch=2, height=16, width=16)),
    ("three_levels", tiny(3, block_out_channels=[8, 16, 16], norm_num_groups=4, latent_channels=4,
                          layers_per_block=1), dict(batch=2, height=24, width=32)),
    ("quant_convs_without_attention",
     tiny(2, block_out_channels=[6, 6], norm_num_groups=2, latent_channels=4, layers_per_block=1, in_channels=4,
          out_channels=2, use_quant_conv=True, use_post_quant_conv=True, mid_block_add_attention=False,
          scaling_factor=0.5, shift_factor=None),
     dict(batch=1, height=16, width=24)),
]


def random_model(config, seed):
    torch.manual_seed(seed)
    model = AutoencoderKL(**config).eval()
    return randomize(model, seed)  # float32 values: forge reads these, diffusers computes on them in float64


def write_config(path, config):
    with open(path, "w") as f:
        json.dump(dict(config, _class_name="AutoencoderKL"), f)


def forge_files(config):
    d = scratch_dir()
    write_config(os.path.join(d, "config.json"), config)
    run([tool("forge_flux_vae_reference"), "files", os.path.join(d, "config.json"), os.path.join(d, "files.json")])
    with open(os.path.join(d, "files.json")) as f:
        return json.load(f)


def bfl_state_dict(model, config):
    """The model's weights under forge's BFL names and shapes."""
    files = forge_files(config)
    state = model.state_dict()
    out = {}
    for (name, shape), (bfl_name, bfl_shape) in zip(files["diffusers"], files["bfl"]):
        out[bfl_name] = state[name].reshape(bfl_shape).contiguous()
    return out


class FluxVaeVsDiffusers(unittest.TestCase):
    def test_file_tensors_are_diffusers_and_bfl_converts_back(self):
        for name, config in [("flux1_dev", FLUX_DEV_CONFIG)] + [(n, c) for n, c, _ in CASES]:
            with self.subTest(name):
                model = random_model(config, 1)
                state = model.state_dict()
                files = forge_files(config)
                self.assertEqual({n: tuple(s) for n, s in files["diffusers"]},
                                 {n: tuple(t.shape) for n, t in state.items()})
                converted = convert_ldm_vae_checkpoint(bfl_state_dict(model, config), config)
                self.assertEqual(set(converted), set(state))
                for key, tensor in state.items():
                    self.assertTrue(torch.equal(converted[key], tensor), key)

    def check(self, name, config, shape, layout):
        d = scratch_dir()
        rng = np.random.RandomState(len(name))
        model = random_model(config, len(name))
        weights = os.path.join(d, "vae")
        args = []
        if layout == "diffusers":
            model.save_pretrained(weights, safe_serialization=True)
        else:
            weights = os.path.join(d, "ae.safetensors")
            save_file(bfl_state_dict(model, config), weights)
            write_config(os.path.join(d, "config.json"), config)
            args = [os.path.join(d, "config.json")]
        b, h, w = shape["batch"], shape["height"], shape["width"]
        f = 2 ** (len(config["block_out_channels"]) - 1)
        latent = (b, config["latent_channels"], h // f, w // f)

        def draw(array, file):
            array = array.astype(np.float32)
            array.tofile(os.path.join(d, file))
            return torch.from_numpy(array.astype(np.float64))

        image = draw(rng.uniform(-1.0, 1.0, (b, config["in_channels"], h, w)), "image.bin")
        noise = draw(rng.standard_normal(latent), "noise.bin")
        latents_in = draw(rng.standard_normal(latent), "latents_in.bin")
        with open(os.path.join(d, "run.json"), "w") as file:
            json.dump(shape, file)
        run([tool("forge_flux_vae_reference"), "run", weights, d] + args)

        def forge(file, shape):
            return np.fromfile(os.path.join(d, file), dtype=np.float32).reshape(shape)

        scale, shift = config["scaling_factor"], config["shift_factor"] or 0.0
        reference = model.double()
        with torch.no_grad():
            dist = reference.encode(image).latent_dist
            expected_moments = dist.parameters.numpy()
            expected_mode = ((dist.mode() - shift) * scale).numpy()
            expected_sample = ((dist.mean + dist.std * noise - shift) * scale).numpy()
            expected_image = reference.decode(latents_in / scale + shift).sample.numpy()
        moments = forge("moments.bin", expected_moments.shape)
        self.assertLess(relative_error(moments, expected_moments), TOLERANCE, "moments")
        self.assertLess(relative_error(forge("latents.bin", latent), expected_mode), TOLERANCE, "mode latents")
        self.assertLess(relative_error(forge("sampled.bin", latent), expected_sample), TOLERANCE, "sampled latents")
        self.assertLess(relative_error(forge("decoded.bin", expected_image.shape), expected_image), TOLERANCE,
                        "decoded image")

    def test_cases(self):
        for name, config, shape in CASES:
            with self.subTest(name):
                self.check(name, config, shape, "diffusers")

    def test_bfl_file(self):
        name, config, shape = CASES[0]
        self.check(name + "_bfl", config, shape, "bfl")


if __name__ == "__main__":
    unittest.main()
