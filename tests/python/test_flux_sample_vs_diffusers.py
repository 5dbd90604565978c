"""forge's FLUX sampling (train/flux_sampler.h, NOTE [FLUX sampling]; `forge sample`) against
diffusers' FluxPipeline on a tiny random pipeline saved as a FLUX.1 folder: transformer, VAE,
T5 and CLIP encoders with trained tokenizers. Both start from the same initial latents and
run on the CPU in float32; the decoded images agree within 1e-4, the schedule's sigmas within
float32 rounding, `forge sample` writes the PNGs diffusers' postprocessing gives (up to one
level where a value sits on a rounding edge), pixel latents decode the transformer's own
output, and bad flags are refused naming what is wrong."""
import io
import json
import os
import shutil
import subprocess
import sys
import unittest

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import clip_fixtures  # noqa: E402
import forge_test_util  # noqa: E402
import sentencepiece_fixtures  # noqa: E402
import tokenizer_fixtures  # noqa: E402

TOOL = forge_test_util.tool("forge_flux_sample_reference")
TOLERANCE = 1e-4
TEXT_TOKENS = 24
HEIGHT, WIDTH = 16, 24  # the VAE's factor is 2 (two levels): latents 8 x 12, 4 x 6 tokens
PROMPTS = ["a red cube on a table", "Two small BLUE spheres, digital art!"]
DEV_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                     num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)
SCHNELL_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                         num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)


def randomize(model, seed, matrix_gain=0.7):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, matrix_gain / p[0].numel() ** 0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    return model.eval()


def tiny_transformer(in_channels, guidance_embeds, seed):
    from diffusers import FluxTransformer2DModel

    return randomize(FluxTransformer2DModel(
        patch_size=1, in_channels=in_channels, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=guidance_embeds,
        axes_dims_rope=[4, 6, 6]), seed)


def t5_tokenizer(directory):
    """A T5-layout SentencePiece unigram model (<pad>, </s>, <unk> as 0, 1, 2) as T5TokenizerFast."""
    import sentencepiece
    from transformers import T5TokenizerFast

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(tokenizer_fixtures.corpus(600)), model_writer=model,
        **{**sentencepiece_fixtures.COMMON_OPTIONS, "vocab_size": 400, "model_type": "unigram", "pad_id": 0, "eos_id": 1, "unk_id": 2,
           "bos_id": -1})
    folder = os.path.join(directory, "spm")
    os.makedirs(folder)
    with open(os.path.join(folder, "spiece.model"), "wb") as f:
        f.write(model.getvalue())
    return T5TokenizerFast.from_pretrained(folder)


def clip_tokenizer(directory):
    from transformers import CLIPTokenizer

    folder = os.path.join(directory, "clip-tokenizer")
    vocab = clip_fixtures.write_vocab_and_merges(folder, clip_fixtures.train_merges(tokenizer_fixtures.corpus(600), 500))
    clip_fixtures.write_json(os.path.join(folder, "tokenizer_config.json"), clip_fixtures.flux_tokenizer_config(vocab))
    clip_fixtures.write_json(os.path.join(folder, "special_tokens_map.json"), clip_fixtures.flux_special_tokens_map())
    return CLIPTokenizer.from_pretrained(folder)


def make_pipeline(directory):
    """A FluxPipeline of tiny random models, saved as a FLUX.1 folder at DIRECTORY/pipeline."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer_2 = t5_tokenizer(directory)
    tokenizer = clip_tokenizer(directory)
    torch.manual_seed(0)
    t5 = randomize(T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), d_model=32, d_kv=8, num_heads=4, d_ff=48,
                                           num_layers=2, feed_forward_proj="gated-gelu", dropout_rate=0.0)), 1)
    clip = randomize(CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=77, hidden_act="quick_gelu", eos_token_id=2, bos_token_id=len(tokenizer) - 2,
        pad_token_id=1)), 2)
    vae = randomize(AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=[8, 16],
        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2, layers_per_block=1,
        norm_num_groups=4, act_fn="silu", use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611,
        shift_factor=0.1159, mid_block_add_attention=True, sample_size=32, force_upcast=True, latents_mean=None,
        latents_std=None), 3, matrix_gain=1.0)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**DEV_SCHEDULER), vae=vae, text_encoder=clip,
                        tokenizer=tokenizer, text_encoder_2=t5, tokenizer_2=tokenizer_2,
                        transformer=tiny_transformer(16, True, 4))
    folder = os.path.join(directory, "pipeline")
    pipe.save_pretrained(folder, safe_serialization=True)
    return pipe, folder


def noise(count, channels, h, w, seed):
    return torch.randn(count, channels, h, w, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def pack(latents):
    from diffusers import FluxPipeline

    n, c, h, w = latents.shape
    return FluxPipeline._pack_latents(latents, n, c, h, w)


def diffusers_images(pipe, latents, guidance, output_type="np", steps=4):
    with torch.no_grad():
        return pipe(prompt=PROMPTS, latents=pack(latents), height=HEIGHT, width=WIDTH, num_inference_steps=steps,
                    guidance_scale=guidance, max_sequence_length=TEXT_TOKENS, output_type=output_type).images


def run_forge(*args, check=True):
    result = subprocess.run([forge_test_util.forge_bin(), "sample", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise AssertionError(f"forge sample {args} exited {result.returncode}\n{result.stderr}")
    return result


def save_noise(path, latents):
    from safetensors.torch import save_file

    save_file({"noise": latents.contiguous()}, path)


def read_png(path):
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


class FluxSampleVsDiffusers(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.directory = forge_test_util.scratch_dir()
        cls.pipe, cls.folder = make_pipeline(cls.directory)
        cls.latents = noise(len(PROMPTS), 4, HEIGHT // 2, WIDTH // 2, seed=7)
        cls.noise_file = os.path.join(cls.directory, "noise.safetensors")
        save_noise(cls.noise_file, cls.latents)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.directory, ignore_errors=True)

    def forge_tool_images(self, guidance, batch_size, folder=None):
        d = forge_test_util.scratch_dir()
        with open(os.path.join(d, "request.json"), "w") as f:
            json.dump({"pipeline": folder or self.folder, "prompts": PROMPTS, "height": HEIGHT, "width": WIDTH, "steps": 4,
                       "guidance": guidance, "text_tokens": TEXT_TOKENS, "batch_size": batch_size}, f)
        self.latents.numpy().astype(np.float32).tofile(os.path.join(d, "noise.bin"))
        forge_test_util.run([TOOL, "sample", d])
        image = np.fromfile(os.path.join(d, "image.bin"), dtype=np.float32).reshape(len(PROMPTS), 3, HEIGHT, WIDTH)
        return d, np.clip(image / 2 + 0.5, 0, 1).transpose(0, 2, 3, 1)

    def test_prompt_encoding(self):
        d, _ = self.forge_tool_images(3.5, 2)
        with torch.no_grad():
            text, pooled, _ = self.pipe.encode_prompt(PROMPTS, None, max_sequence_length=TEXT_TOKENS)
        forge_text = np.fromfile(os.path.join(d, "text.bin"), dtype=np.float32).reshape(text.shape)
        forge_pooled = np.fromfile(os.path.join(d, "pooled.bin"), dtype=np.float32).reshape(pooled.shape)
        self.assertLess(forge_test_util.relative_error(forge_text, text.numpy()), TOLERANCE)
        self.assertLess(forge_test_util.relative_error(forge_pooled, pooled.numpy()), TOLERANCE)

    def test_images_match_diffusers(self):
        for guidance, batch_size in ((3.5, 2), (1.0, 1)):
            with self.subTest(guidance=guidance, batch_size=batch_size):
                expected = diffusers_images(self.pipe, self.latents, guidance)
                _, got = self.forge_tool_images(guidance, batch_size)
                self.assertGreater(float(expected.std()), 0.05)  # a picture, not a flat field
                self.assertLess(forge_test_util.relative_error(got, expected), TOLERANCE)

    def test_schnell_like_pipeline(self):
        """No guidance embedding, FLUX.1-schnell's scheduler (no shift) read from the folder."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        d = forge_test_util.scratch_dir()
        folder = os.path.join(d, "schnell")
        shutil.copytree(self.folder, folder)
        transformer = tiny_transformer(16, False, 6)
        scheduler = FlowMatchEulerDiscreteScheduler(**SCHNELL_SCHEDULER)
        shutil.rmtree(os.path.join(folder, "transformer"))
        transformer.save_pretrained(os.path.join(folder, "transformer"), safe_serialization=True)
        scheduler.save_pretrained(os.path.join(folder, "scheduler"))
        saved = (self.pipe.transformer, self.pipe.scheduler)
        try:
            self.pipe.transformer, self.pipe.scheduler = transformer, scheduler
            expected = diffusers_images(self.pipe, self.latents, 3.5)
        finally:
            self.pipe.transformer, self.pipe.scheduler = saved
        _, got = self.forge_tool_images(3.5, 2, folder)
        self.assertLess(forge_test_util.relative_error(got, expected), TOLERANCE)

    def test_cuda_matches_diffusers(self):
        """--device cuda (bf16) against diffusers' float32 images, on a machine with a GPU and
        a CUDA build; skipped elsewhere."""
        out = os.path.join(forge_test_util.scratch_dir(), "cuda")
        result = run_forge("--pipeline", self.folder, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--width",
                           str(WIDTH), "--height", str(HEIGHT), "--steps", "4", "--text-tokens", str(TEXT_TOKENS),
                           "--initial-noise", self.noise_file, "--batch-size", "2", "--device", "cuda", "--output",
                           out, check=False)
        if "no GPU is visible" in result.stderr:
            self.skipTest("no GPU or no CUDA backend")
        self.assertEqual(result.returncode, 0, result.stderr)
        expected = diffusers_images(self.pipe, self.latents, 3.5, output_type="pil")
        for name, want in zip(sorted(os.listdir(out)), expected):
            difference = np.abs(read_png(os.path.join(out, name)).astype(int) - np.asarray(want).astype(int))
            self.assertLess(float(difference.mean()), 4.0, name)  # bf16 weights and activations: a few levels
            self.assertGreater(float((difference <= 8).mean()), 0.95, name)

    def test_sigmas_match_the_scheduler(self):
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        d = forge_test_util.scratch_dir()
        for name, config in (("dev", DEV_SCHEDULER), ("schnell", SCHNELL_SCHEDULER)):
            folder = os.path.join(d, name)
            scheduler = FlowMatchEulerDiscreteScheduler(**config)
            scheduler.save_pretrained(folder)
            for steps in (1, 2, 4, 28, 50):
                for tokens in (1, 24, 256, 1024, 4096, 16384):
                    mu = calculate_shift(tokens, 256, 4096, 0.5, 1.15)
                    scheduler.set_timesteps(steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
                    out = os.path.join(d, "sigmas.json")
                    forge_test_util.run([TOOL, "sigmas", folder, str(steps), str(tokens), out])
                    with open(out) as f:
                        got = json.load(f)
                    np.testing.assert_allclose(got["sigmas"], scheduler.sigmas.numpy(), rtol=2e-7, atol=1e-7,
                                               err_msg=f"{name}, {steps} steps, {tokens} tokens")
                    times = (scheduler.timesteps / 1000).numpy()
                    np.testing.assert_array_equal(np.array(got["times"][:-1], dtype=np.float32), times)

    def test_forge_sample_writes_the_pngs(self):
        out = os.path.join(forge_test_util.scratch_dir(), "samples")
        run_forge("--pipeline", self.folder, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--width", str(WIDTH),
                  "--height", str(HEIGHT), "--steps", "4", "--text-tokens", str(TEXT_TOKENS), "--initial-noise",
                  self.noise_file, "--output", out)
        self.assertEqual(sorted(os.listdir(out)), ["000-a-red-cube-on-a-table.png",
                                                   "001-two-small-blue-spheres-digital-art.png"])
        expected = diffusers_images(self.pipe, self.latents, 3.5, output_type="pil")
        for name, want in zip(sorted(os.listdir(out)), expected):
            got, want = read_png(os.path.join(out, name)).astype(int), np.asarray(want).astype(int)
            self.assertEqual(got.shape, (HEIGHT, WIDTH, 3))
            self.assertLessEqual(int(np.abs(got - want).max()), 1, name)
            self.assertGreater(float((got == want).mean()), 0.99, name)
        # Existing files stay unless --overwrite.
        again = run_forge("--pipeline", self.folder, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--width",
                          str(WIDTH), "--height", str(HEIGHT), "--steps", "1", "--text-tokens", str(TEXT_TOKENS),
                          "--output", out, check=False)
        self.assertEqual(again.returncode, 1)
        self.assertIn("000-a-red-cube-on-a-table.png exists", again.stderr)
        run_forge("--pipeline", self.folder, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--width", str(WIDTH),
                  "--height", str(HEIGHT), "--steps", "1", "--text-tokens", str(TEXT_TOKENS), "--output", out,
                  "--overwrite")

    def test_forge_noise_is_the_seeds_and_the_images(self):
        """forge's own noise: an image depends on the seed and its number, not on the batch."""
        d = forge_test_util.scratch_dir()
        common = ["--pipeline", self.folder, "--prompt", PROMPTS[0], "--width", str(WIDTH), "--height", str(HEIGHT),
                  "--steps", "2", "--text-tokens", str(TEXT_TOKENS), "--images-per-prompt", "3"]
        run_forge(*common, "--seed", "5", "--output", os.path.join(d, "one"))
        run_forge(*common, "--seed", "5", "--batch-size", "2", "--output", os.path.join(d, "two"))
        run_forge(*common, "--seed", "6", "--output", os.path.join(d, "other"))
        names = sorted(os.listdir(os.path.join(d, "one")))
        self.assertEqual(names, [f"00{i}-a-red-cube-on-a-table.png" for i in range(3)])
        for name in names:
            np.testing.assert_array_equal(read_png(os.path.join(d, "one", name)), read_png(os.path.join(d, "two", name)))
        self.assertFalse(np.array_equal(read_png(os.path.join(d, "one", names[0])),
                                        read_png(os.path.join(d, "one", names[1]))))
        self.assertFalse(np.array_equal(read_png(os.path.join(d, "one", names[0])),
                                        read_png(os.path.join(d, "other", names[0]))))
        single = os.path.join(d, "single.png")
        run_forge("--pipeline", self.folder, "--prompt", PROMPTS[1], "--width", "8", "--height", "4", "--steps", "1",
                  "--text-tokens", "8", "--output", single)
        self.assertEqual(read_png(single).shape, (4, 8, 3))

    def test_pixel_latents(self):
        """--vae pixels: the transformer's latents folded back into pixels (NOTE [Pixel latents])."""
        from safetensors.torch import save_file  # noqa: F401

        d = forge_test_util.scratch_dir()
        transformer = tiny_transformer(64, False, 5)
        transformer.save_pretrained(os.path.join(d, "transformer"), safe_serialization=True)
        latents = noise(1, 16, HEIGHT // 2, WIDTH // 2, seed=9)
        save_noise(os.path.join(d, "noise.safetensors"), latents)
        original = self.pipe.transformer
        try:
            self.pipe.transformer = transformer
            with torch.no_grad():
                packed = self.pipe(prompt=PROMPTS[:1], latents=pack(latents), height=HEIGHT, width=WIDTH,
                                   num_inference_steps=3, max_sequence_length=TEXT_TOKENS,
                                   output_type="latent").images
        finally:
            self.pipe.transformer = original
        # _unpack_latents, then the pixel fold: latent channel (dy * 2 + dx) * 4 + c is pixel (2y + dy, 2x + dx).
        z = packed.view(1, HEIGHT // 4, WIDTH // 4, 16, 2, 2).permute(0, 3, 1, 4, 2, 5)
        z = z.reshape(1, 16, HEIGHT // 2, WIDTH // 2).numpy()[0]
        image = np.zeros((HEIGHT, WIDTH, 3), dtype=np.float32)
        for dy in range(2):
            for dx in range(2):
                for c in range(3):
                    image[dy::2, dx::2, c] = z[(dy * 2 + dx) * 4 + c]
        expected = np.round(np.clip(image / 2 + 0.5, 0, 1) * 255).astype(int)
        out = os.path.join(d, "pixels.png")
        run_forge("--transformer", os.path.join(d, "transformer"), "--vae", "pixels", "--t5", self.folder,
                  "--t5-tokenizer", self.folder, "--clip", self.folder, "--clip-tokenizer", self.folder,
                  "--prompt", PROMPTS[0], "--width", str(WIDTH), "--height", str(HEIGHT), "--steps", "3",
                  "--text-tokens", str(TEXT_TOKENS), "--initial-noise", os.path.join(d, "noise.safetensors"),
                  "--output", out)
        got = read_png(out).astype(int)
        self.assertLessEqual(int(np.abs(got - expected).max()), 1)
        self.assertGreater(float((got == expected).mean()), 0.99)
        self.assertGreater(float(expected.std()), 5)

    def test_samples_what_a_flux_run_exports(self):
        """forge train's flux.last_save_in_diffusers folder (flux-debug: T5 features 32 and a
        pooled 16, as this pipeline's encoders) is what --transformer reads, by its config.json."""
        d = forge_test_util.scratch_dir()
        run_dir = os.path.join(d, "run")
        experiment = os.path.join(forge_test_util.source_dir(), "configs", "experiments", "cpu", "flux-debug.yaml")
        forge_test_util.run([forge_test_util.forge_bin(), "train", experiment, "--training.steps", "1",
                             "--logging.run_dir", run_dir, "--flux.last_save_in_diffusers", "true"])
        out = os.path.join(d, "shapes")
        result = run_forge("--transformer", os.path.join(run_dir, "diffusers"), "--vae", "pixels", "--t5",
                           self.folder, "--t5-tokenizer", self.folder, "--clip", self.folder, "--clip-tokenizer",
                           self.folder, "--prompt", "a red square", "--prompt", "a blue circle", "--width", "16",
                           "--height", "12", "--steps", "2", "--text-tokens", "16", "--batch-size", "2", "--output",
                           out)
        self.assertIn("FLUX transformer flux-debug", result.stdout + result.stderr)
        self.assertEqual(sorted(os.listdir(out)), ["000-a-red-square.png", "001-a-blue-circle.png"])
        self.assertEqual(read_png(os.path.join(out, "000-a-red-square.png")).shape, (12, 16, 3))

    def test_refusals(self):
        d = forge_test_util.scratch_dir()
        bad_scheduler = os.path.join(d, "bad-pipeline")
        shutil.copytree(self.folder, bad_scheduler)
        with open(os.path.join(bad_scheduler, "scheduler", "scheduler_config.json"), "w") as f:
            json.dump(dict(DEV_SCHEDULER, use_karras_sigmas=True), f)
        wrong_noise = os.path.join(d, "wrong-noise.safetensors")
        save_noise(wrong_noise, noise(1, 4, 4, 4, seed=1))
        defaults = {"--pipeline": self.folder, "--prompt": "x", "--width": str(WIDTH), "--height": str(HEIGHT),
                    "--text-tokens": str(TEXT_TOKENS), "--steps": "1", "--output": os.path.join(d, "out")}
        cases = [
            ({"--width": "18"}, "--width 18: expected a positive multiple of 4"),
            ({"--height": "0"}, "--height 0: expected a positive multiple of 4"),
            ({"--steps": "0"}, "--steps 0: expected 1 to 10000"),
            ({"--guidance": "-1"}, "--guidance -1: expected a finite number >= 0"),
            ({"--images-per-prompt": "0"}, "--images-per-prompt 0"),
            ({"--batch-size": "0"}, "--batch-size 0"),
            ({"--text-tokens": "0"}, "--text-tokens 0: expected 1 to 512"),
            ({"--text-tokens": "513"}, "--text-tokens 513: expected 1 to 512"),
            ({"--device": "gpu"}, "--device 'gpu': expected cpu or cuda"),
            ({"--model": "flux3"}, "--model 'flux3': expected one of flux1-dev, flux1-schnell, flux-small, flux-debug"),
            ({"--model": "flux-debug"}, "its latents have 4 channels, 2x2-packed 16 features"),
            ({"--num-double-blocks": "1"}, "go with --model"),
            ({"--images-per-prompt": "2", "--output": os.path.join(d, "one.png")},
             "one PNG file, but 2 images are drawn"),
            ({"--prompts": os.path.join(d, "missing.txt")}, "missing.txt: cannot open"),
            ({"--initial-noise": wrong_noise}, "tensor 'noise' is [1, 4, 4, 4]; expected [1, 4, 8, 12]"),
            ({"--vae": os.path.join(d, "nowhere")}, "--vae " + os.path.join(d, "nowhere") + ": not found"),
            ({"--pipeline": bad_scheduler}, "\"use_karras_sigmas\" is true"),
            ({"--scheduler": os.path.join(bad_scheduler, "scheduler")}, "\"use_karras_sigmas\" is true"),
            ({"--scheduler": d}, "no scheduler_config.json in it"),
        ]
        for extra, message in cases:
            with self.subTest(extra=extra):
                args = [item for pair in {**defaults, **extra}.items() for item in pair]
                result = run_forge(*args, check=False)
                self.assertEqual(result.returncode, 1, result.stderr)
                self.assertIn(message, result.stderr)
                self.assertNotIn("check failed", result.stderr)
        empty = os.path.join(d, "empty.txt")
        with open(empty, "w") as f:
            f.write("\n  \n")
        result = run_forge("--pipeline", self.folder, "--prompts", empty, "--output", os.path.join(d, "o"), check=False)
        self.assertEqual(result.returncode, 1)
        self.assertIn("no caption in its 2 line(s)", result.stderr)
        result = run_forge("--transformer", self.folder, "--prompt", "x", "--output", os.path.join(d, "o"), check=False)
        self.assertEqual(result.returncode, 1)
        self.assertIn("--vae is needed (or --pipeline DIR", result.stderr)
        self.assertFalse(os.path.exists(os.path.join(d, "out")))


if __name__ == "__main__":
    unittest.main()
