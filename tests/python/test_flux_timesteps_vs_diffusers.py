"""forge's rectified-flow timestep sampling (NOTE [Flow timesteps], train/flow_timesteps.h)
against diffusers' own functions, through tests/tools/forge_flow_timesteps:
  - the resolution shift: diffusers.pipelines.flux.pipeline_flux.calculate_shift (mu for an
    image's token count) and FlowMatchEulerDiscreteScheduler's exponential time_shift, both
    in double, and the scheduler's set_timesteps(sigmas=..., mu=...) with
    use_dynamic_shifting (fp32), with FLUX's defaults and other base/max shifts and lengths;
  - the fixed shift: FlowMatchEulerDiscreteScheduler(shift=s).set_timesteps(sigmas=...);
  - the weighting: diffusers.training_utils.compute_density_for_timestep_sampling, whose
    logit_normal is sigmoid(torch.normal(mean, std)) and uniform torch.rand: forge maps the
    same normals (torch.randn from the same generator state) and uniforms to the same t.
"""
import subprocess
import unittest

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from diffusers.training_utils import compute_density_for_timestep_sampling

from forge_test_util import tool

T0 = [1e-4, 0.01, 0.1, 0.25, 0.5, 0.6180339887, 0.75, 0.9, 0.99, 0.9999]


def forge_times(draws, **settings):
    args = [tool("forge_flow_timesteps"), *(f"{k}={v}" for k, v in settings.items()), *(repr(float(d)) for d in draws)]
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode != 0:
        raise AssertionError(f"{args} exited {result.returncode}: {result.stderr}")
    return np.array([float(line) for line in result.stdout.split()])


class ResolutionShift(unittest.TestCase):
    LINES = [dict(base_shift=0.5, max_shift=1.15, base_seq_len=256, max_seq_len=4096),
             dict(base_shift=0.25, max_shift=1.6, base_seq_len=64, max_seq_len=8192)]

    def test_time_shift_of_calculate_shift(self):
        for line in self.LINES:
            scheduler = FlowMatchEulerDiscreteScheduler(
                use_dynamic_shifting=True, base_shift=line["base_shift"], max_shift=line["max_shift"],
                base_image_seq_len=line["base_seq_len"], max_image_seq_len=line["max_seq_len"])
            for seq_len in [16, 256, 1024, 3600, 4096, 6000]:
                mu = calculate_shift(seq_len, line["base_seq_len"], line["max_seq_len"], line["base_shift"],
                                     line["max_shift"])
                want = scheduler.time_shift(mu, 1.0, torch.tensor(T0, dtype=torch.float64)).numpy()
                got = forge_times(T0, weighting="uniform", shift="resolution", seq_len=seq_len, **line)
                np.testing.assert_allclose(got, want, rtol=1e-13, atol=0, err_msg=f"{line} seq_len {seq_len}")
                scheduler.set_timesteps(sigmas=T0, mu=mu)
                np.testing.assert_allclose(got, scheduler.sigmas[:-1].numpy(), rtol=1e-6, atol=0,
                                           err_msg=f"set_timesteps {line} seq_len {seq_len}")


class FixedShift(unittest.TestCase):
    def test_scheduler_shift(self):
        for shift in [1.0, 3.0, 0.5, 7.25]:
            scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
            scheduler.set_timesteps(sigmas=T0)
            got = forge_times(T0, weighting="uniform", shift="fixed", shift_value=shift)
            np.testing.assert_allclose(got, scheduler.sigmas[:-1].numpy(), rtol=1e-6, atol=0, err_msg=f"shift {shift}")


class Weighting(unittest.TestCase):
    def test_logit_normal_is_sigmoid_of_the_same_normals(self):
        for mean, std, seed in [(0.0, 1.0, 0), (0.5, 1.2, 1), (-1.0, 0.7, 2)]:
            u = compute_density_for_timestep_sampling("logit_normal", 64, logit_mean=mean, logit_std=std,
                                                      generator=torch.Generator().manual_seed(seed))
            z = torch.randn(64, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
            got = forge_times(z.double().numpy(), weighting="logit_normal", logit_mean=mean, logit_std=std, shift="none")
            # diffusers draws mean + std z and takes the sigmoid in fp32.
            np.testing.assert_allclose(got, u.double().numpy(), rtol=0, atol=1e-6, err_msg=f"{mean} {std}")

    def test_uniform_is_the_draw(self):
        u = compute_density_for_timestep_sampling("uniform", 64, generator=torch.Generator().manual_seed(3))
        got = forge_times(u.double().numpy(), weighting="uniform", shift="none")
        np.testing.assert_array_equal(got, u.double().numpy())


class BadSettings(unittest.TestCase):
    def test_validate_names_the_key(self):
        result = subprocess.run([tool("forge_flow_timesteps"), "logit_std=0", "0.5"], capture_output=True, text=True)
        self.assertEqual(result.returncode, 1)
        self.assertIn("flux.logit_std must be > 0", result.stderr)


if __name__ == "__main__":
    unittest.main()
