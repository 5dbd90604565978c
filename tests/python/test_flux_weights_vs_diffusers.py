"""FLUX weights in and out of both published layouts (NOTE [FLUX weight files]) on a tiny
random model: forge reads a folder diffusers' save_pretrained wrote, exactly; forge's
diffusers export loads with FluxTransformer2DModel.from_pretrained to the same values, cut into
shards with their index too; forge's
BFL export, converted by diffusers' own convert_flux_transformer_checkpoint_to_diffusers
(its hard-coded 3072 width replaced by the tiny model's), loads strictly into diffusers'
model with the same values, and forge reads it back exactly. Files of another shape, with a
tensor too many, or whose config.json disagrees are refused naming the file and tensor."""
import inspect
import json
import os
import shutil
import unittest

import numpy as np
import torch
from diffusers import FluxTransformer2DModel
from diffusers.loaders import single_file_utils
from safetensors.torch import load_file, save_file

from forge_test_util import run, scratch_dir, tool

CONFIG = dict(in_channels=16, out_channels=0, num_heads=2, head_dim=16, axes_dim=[4, 6, 6], num_double_blocks=2,
              num_single_blocks=2, context_dim=24, pooled_dim=12, guidance_embeds=True)


def diffusers_model(c, seed=0):
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=c["in_channels"], out_channels=c["out_channels"] or None,
        num_layers=c["num_double_blocks"], num_single_layers=c["num_single_blocks"],
        attention_head_dim=c["head_dim"], num_attention_heads=c["num_heads"], joint_attention_dim=c["context_dim"],
        pooled_projection_dim=c["pooled_dim"], guidance_embeds=c["guidance_embeds"],
        axes_dims_rope=tuple(c["axes_dim"]))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def bfl_to_diffusers(state, hidden):
    """diffusers' converter with its width (3072, FLUX.1's) set to the tiny model's."""
    source = inspect.getsource(single_file_utils.convert_flux_transformer_checkpoint_to_diffusers)
    assert "inner_dim = 3072" in source
    namespace = dict(vars(single_file_utils))
    exec(source.replace("inner_dim = 3072", f"inner_dim = {hidden}"), namespace)
    return namespace["convert_flux_transformer_checkpoint_to_diffusers"](dict(state))


class FluxWeights(unittest.TestCase):
    def setUp(self):
        self.dir = scratch_dir()
        with open(os.path.join(self.dir, "config.json"), "w") as f:
            json.dump(CONFIG, f)
        run([tool("forge_flux_reference"), "specs", self.dir])
        with open(os.path.join(self.dir, "specs.json")) as f:
            self.specs = json.load(f)
        self.model = diffusers_model(CONFIG)
        self.params = {k: v.detach() for k, v in self.model.state_dict().items()}

    def stacked(self, params):
        return np.concatenate([torch.cat([params[n].reshape(r, -1) for n, r in s["hf"]]).numpy().ravel()
                               for s in self.specs]).astype(np.float32)

    def load(self, path):
        run([tool("forge_flux_reference"), "load", self.dir, path])
        return np.fromfile(os.path.join(self.dir, "loaded.bin"), dtype=np.float32)

    def assert_same_model(self, params):
        for name, value in self.params.items():
            self.assertTrue(torch.equal(params[name].to(value.dtype), value), name)

    def test_diffusers_folder_in_and_out(self):
        folder = os.path.join(self.dir, "saved")
        self.model.save_pretrained(folder)
        np.testing.assert_array_equal(self.load(folder), self.stacked(self.params))
        # A pipeline's folder: the transformer/ subfolder is found.
        pipeline = os.path.join(self.dir, "pipeline")
        shutil.copytree(folder, os.path.join(pipeline, "transformer"))
        np.testing.assert_array_equal(self.load(pipeline), self.stacked(self.params))
        self.stacked(self.params).tofile(os.path.join(self.dir, "weights.bin"))
        exported = os.path.join(self.dir, "exported")
        run([tool("forge_flux_reference"), "export", self.dir, exported, "diffusers"])
        back = FluxTransformer2DModel.from_pretrained(exported)
        self.assert_same_model({k: v.detach() for k, v in back.state_dict().items()})
        # Cut into shards of at most 20 kB (NOTE [FLUX export in pieces]), with diffusers' index.
        sharded = os.path.join(self.dir, "sharded")
        run([tool("forge_flux_reference"), "export", self.dir, sharded, "diffusers", "20000"])
        names = sorted(os.listdir(sharded))
        self.assertIn("diffusion_pytorch_model.safetensors.index.json", names)
        shards = [n for n in names if n.startswith("diffusion_pytorch_model-")]
        self.assertGreater(len(shards), 2)
        self.assertEqual(shards[0], f"diffusion_pytorch_model-00001-of-{len(shards):05d}.safetensors")
        back = FluxTransformer2DModel.from_pretrained(sharded)
        self.assert_same_model({k: v.detach() for k, v in back.state_dict().items()})
        np.testing.assert_array_equal(self.load(sharded), self.stacked(self.params))

    def test_bfl_file_in_and_out(self):
        self.stacked(self.params).tofile(os.path.join(self.dir, "weights.bin"))
        bfl = os.path.join(self.dir, "flux-tiny.safetensors")
        run([tool("forge_flux_reference"), "export", self.dir, bfl, "bfl"])
        converted = bfl_to_diffusers(load_file(bfl), CONFIG["num_heads"] * CONFIG["head_dim"])
        fresh = diffusers_model(CONFIG, seed=1)
        fresh.load_state_dict(converted, strict=True)
        self.assert_same_model({k: v.detach() for k, v in fresh.state_dict().items()})
        np.testing.assert_array_equal(self.load(bfl), self.stacked(self.params))

    def test_bad_files_are_refused(self):
        folder = os.path.join(self.dir, "saved")
        self.model.save_pretrained(folder)
        weights = os.path.join(folder, "diffusion_pytorch_model.safetensors")
        state = load_file(weights)
        # A tensor the model has no place for.
        extra = os.path.join(self.dir, "extra")
        shutil.copytree(folder, extra)
        save_file(dict(state, **{"transformer_blocks.9.norm1.linear.weight": torch.zeros(2, 2)}),
                  os.path.join(extra, "diffusion_pytorch_model.safetensors"))
        result = run_fails(self, [tool("forge_flux_reference"), "load", self.dir, extra])
        self.assertIn("'transformer_blocks.9.norm1.linear.weight' has no place", result)
        # A single file is BFL's: diffusers' names are missing BFL's, named.
        result = run_fails(self, [tool("forge_flux_reference"), "load", self.dir,
                                  os.path.join(folder, "diffusion_pytorch_model.safetensors")])
        self.assertIn("BFL layout", result)
        # A tensor of the wrong shape.
        bad = os.path.join(self.dir, "bad")
        shutil.copytree(folder, bad)
        state["proj_out.weight"] = torch.zeros(3, 3)
        save_file(state, os.path.join(bad, "diffusion_pytorch_model.safetensors"))
        result = run_fails(self, [tool("forge_flux_reference"), "load", self.dir, bad])
        self.assertIn("'proj_out.weight' is [3, 3]", result)
        # config.json of another architecture.
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        config["num_layers"] = 5
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
        result = run_fails(self, [tool("forge_flux_reference"), "load", self.dir, folder])
        self.assertIn('"num_layers" is 5', result)
        result = run_fails(self, [tool("forge_flux_reference"), "load", self.dir, os.path.join(self.dir, "missing")])
        self.assertIn("not found", result)


def run_fails(test, args):
    import subprocess
    result = subprocess.run(args, capture_output=True, text=True)
    test.assertNotEqual(result.returncode, 0, result.stdout)
    return result.stderr


if __name__ == "__main__":
    unittest.main()
