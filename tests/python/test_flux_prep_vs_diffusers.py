"""forge prep --images against diffusers: a FluxPipeline-like folder of tiny random models
(AutoencoderKL with FLUX's 16 latent channels and 8x downsampling, a CLIPTextModel with its
CLIP tokenizer, a T5EncoderModel with a T5 SentencePiece tokenizer) and a few PNG and JPEG
images with captions go through `forge prep --images` on the CPU (fp32) and through
scripts/flux_cache_from_diffusers.py (diffusers and transformers in float64); every latent,
prompt_embeds and pooled_prompt_embeds row must agree within 1e-4 relative error, matched
by image. Also: the diffusers-made cache opens and reads back in forge (FluxLatentCache,
through tests/tools/forge_flux_cache_read), bf16 storage is the fp32 values rounded to
nearest even, --vae pixels equals the script's pixel fold exactly, several buckets, encoders
given one by one instead of --pipeline, and the CLI's refusals (nothing on disk lost).
--latents distribution stores diffusers' latent_dist.mean and .logvar, and every cache holds
the empty caption's encodings as diffusers' encode_prompt("") gives them."""
import json
import math
import os
import shutil
import subprocess
import sys
import unittest

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(__file__))
import clip_fixtures  # noqa: E402
import sentencepiece_fixtures  # noqa: E402
import tokenizer_fixtures  # noqa: E402
from flux_fixtures import randomize  # noqa: E402
from forge_test_util import forge_bin, relative_error, run, scratch_dir, source_dir, tool  # noqa: E402

sys.path.insert(0, os.path.join(source_dir(), "scripts"))
import flux_cache_from_diffusers as script  # noqa: E402

TOLERANCE = 1e-4
CAPTIONS = {
    "a.png": "a red circle on a blue background",
    "b.jpg": "Two green squares, one small and one LARGE!",
    "c.png": "a photo of a cat sitting on a windowsill at night",
    "d.jpg": "café naïve 漢字 and emoji 😀",
    "e.png": "word " * 40,
}
SIZES = {"a.png": (40, 24), "b.jpg": (32, 32), "c.png": (24, 48), "d.jpg": (50, 30), "e.png": (33, 31)}


def make_pipeline(root):
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel, T5TokenizerFast

    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[8, 8, 8, 8],
                        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                        layers_per_block=1, norm_num_groups=4, act_fn="silu", use_quant_conv=False,
                        use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159,
                        mid_block_add_attention=True, sample_size=32, force_upcast=True)
    randomize(vae, 1).save_pretrained(os.path.join(root, "vae"))

    tokenizer = os.path.join(root, "tokenizer")
    merges = clip_fixtures.train_merges(tokenizer_fixtures.corpus(400) + list(CAPTIONS.values()), 400)
    vocab = clip_fixtures.write_vocab_and_merges(tokenizer, merges)
    clip_fixtures.write_json(os.path.join(tokenizer, "tokenizer_config.json"), clip_fixtures.flux_tokenizer_config(vocab))
    clip_fixtures.write_json(os.path.join(tokenizer, "special_tokens_map.json"), clip_fixtures.flux_special_tokens_map())
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=40,
                                        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=77,
                                        hidden_act="quick_gelu", eos_token_id=2, bos_token_id=len(vocab) - 2,
                                        pad_token_id=1))
    randomize(clip, 2).save_pretrained(os.path.join(root, "text_encoder"))

    spiece = os.path.join(os.path.dirname(root), "spiece-source")
    os.makedirs(spiece)
    sentencepiece_fixtures.train("spiece", dict(model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1),
                                 spiece)
    t5_tokenizer = T5TokenizerFast(vocab_file=os.path.join(spiece, "spiece.model"))
    t5_tokenizer.save_pretrained(os.path.join(root, "tokenizer_2"))
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tokenizer) + 8, d_model=32, d_kv=8, num_heads=4, d_ff=48,
                                 num_layers=2, feed_forward_proj="gated-gelu", dropout_rate=0.0,
                                 relative_attention_num_buckets=8, relative_attention_max_distance=16))
    randomize(t5, 3).save_pretrained(os.path.join(root, "text_encoder_2"))


def make_images(folder):
    os.makedirs(folder)
    rng = np.random.default_rng(0)
    for name, (w, h) in SIZES.items():
        pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        image = Image.fromarray(pixels)
        if name.endswith(".jpg"):
            image.save(os.path.join(folder, name), quality=90)
        else:
            image.save(os.path.join(folder, name))
        with open(os.path.join(folder, os.path.splitext(name)[0] + ".txt"), "w", encoding="utf-8") as f:
            f.write(CAPTIONS[name])


def forge(*args):
    return subprocess.run([forge_bin(), "prep", *args], capture_output=True, text=True, timeout=300)


def load_cache(folder):
    """cache.json and {image file name: (latents, prompt_embeds, pooled)} in float64 (an fp32 cache)."""
    from safetensors.numpy import load_file

    with open(os.path.join(folder, "cache.json")) as f:
        manifest = json.load(f)
    shards = [load_file(os.path.join(folder, s["file"])) for s in manifest["shards"]]
    samples = {}
    with open(os.path.join(folder, "captions.jsonl"), encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            shard = shards[row["shard"]]
            samples[os.path.basename(row["image"])] = tuple(
                np.asarray(shard[k][row["row"]], dtype=np.float64)
                for k in ("latents", "prompt_embeds", "pooled_prompt_embeds"))
            assert row["caption"] == CAPTIONS[os.path.basename(row["image"])].strip(), row
    return manifest, samples


class FluxPrepVsDiffusers(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = scratch_dir()
        cls.pipeline = os.path.join(cls.root, "pipeline")
        make_pipeline(cls.pipeline)
        cls.images = os.path.join(cls.root, "images")
        make_images(cls.images)

    def out(self, name):
        return os.path.join(self.root, name)

    def diffusers_cache(self, name, *args):
        path = self.out(name)
        script.main(["--images", self.images, "--pipeline", self.pipeline, "--output", path, "--text-tokens", "24",
                     "--dtype", "fp32", "--torch-dtype", "float64", "--batch-size", "2", *args])
        return path

    def forge_cache(self, name, *args):
        path = self.out(name)
        result = forge("--images", self.images, "--output", path, "--text-tokens", "24", "--batch-size", "2",
                       "--device", "cpu", *args)
        self.assertEqual(result.returncode, 0, result.stderr)
        return path, result.stdout + result.stderr

    def compare(self, forge_path, diffusers_path, exact=False):
        forge_manifest, forge_samples = load_cache(forge_path)
        reference_manifest, reference_samples = load_cache(diffusers_path)
        for key in ("format", "version", "autoencoder", "latent_channels", "text_tokens", "context_dim", "pooled_dim",
                    "dtype", "samples", "shards"):
            self.assertEqual(forge_manifest[key], reference_manifest[key], key)
        self.assertEqual(set(forge_samples), set(CAPTIONS))
        for image, expected in reference_samples.items():
            for kind, got, want in zip(("latents", "prompt_embeds", "pooled"), forge_samples[image], expected):
                if exact:
                    np.testing.assert_array_equal(got, want, err_msg=f"{image} {kind}")
                else:
                    self.assertLess(relative_error(got, want), TOLERANCE, f"{image} {kind}")

    def test_square_bucket_matches_diffusers(self):
        forge_path, log = self.forge_cache("forge-square", "--pipeline", self.pipeline, "--resolution", "32",
                                           "--dtype", "fp32", "--shard-samples", "3")
        self.assertIn("5 images in 1 bucket", log)
        self.assertIn("images/s", log)
        reference = self.diffusers_cache("diffusers-square", "--resolution", "32", "--shard-samples", "3")
        self.compare(forge_path, reference)
        # The diffusers-made cache opens in forge and reads back as stored.
        read = self.out("read-back")
        os.makedirs(read)
        run([tool("forge_flux_cache_read"), reference, read])
        manifest, samples = load_cache(reference)
        with open(os.path.join(reference, "captions.jsonl"), encoding="utf-8") as f:
            order = [os.path.basename(json.loads(line)["image"]) for line in f]
        for k, name in enumerate(("latents", "prompt_embeds", "pooled_prompt_embeds")):
            got = np.fromfile(os.path.join(read, name + ".bin"), dtype=np.float32)
            want = np.concatenate([samples[image][k].astype(np.float32).ravel() for image in order])
            np.testing.assert_array_equal(got, want, err_msg=name)

    def test_buckets_given_encoders_and_bf16(self):
        from safetensors.torch import load_file

        p = self.pipeline
        encoders = ("--vae", os.path.join(p, "vae"), "--t5", os.path.join(p, "text_encoder_2"), "--clip",
                    os.path.join(p, "text_encoder"))
        fp32, log = self.forge_cache("forge-buckets", *encoders, "--buckets", "32x32,48x32,32x48", "--dtype", "fp32")
        self.assertIn("in 3 buckets", log)
        reference = self.diffusers_cache("diffusers-buckets", "--buckets", "32x32,48x32,32x48")
        self.compare(fp32, reference)
        bf16, _ = self.forge_cache("forge-buckets-bf16", *encoders, "--buckets", "32x32,48x32,32x48")
        with open(os.path.join(bf16, "cache.json")) as f:
            self.assertEqual(json.load(f)["dtype"], "bf16")
        for shard in ("shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"):
            full, rounded = load_file(os.path.join(fp32, shard)), load_file(os.path.join(bf16, shard))
            for name, tensor in full.items():
                self.assertTrue(torch.equal(tensor.to(torch.bfloat16), rounded[name]), f"{shard} {name}")
        os.makedirs(self.out("read-bf16"))
        run([tool("forge_flux_cache_read"), bf16, self.out("read-bf16")])

    def test_pixel_latents_match_exactly(self):
        forge_path, _ = self.forge_cache("forge-pixels", "--pipeline", self.pipeline, "--vae", "pixels",
                                         "--resolution", "32", "--dtype", "fp32")
        reference = self.diffusers_cache("diffusers-pixels", "--vae", "pixels", "--resolution", "32")
        with open(os.path.join(forge_path, "cache.json")) as f:
            manifest = json.load(f)
        self.assertEqual(manifest["autoencoder"], "pixels")
        self.assertEqual(manifest["shards"][0]["width"], 32)
        _, forge_samples = load_cache(forge_path)
        _, reference_samples = load_cache(reference)
        for image in CAPTIONS:
            np.testing.assert_array_equal(forge_samples[image][0], reference_samples[image][0], err_msg=image)
            self.assertEqual(forge_samples[image][0].shape, (16, 16, 16))

    def test_manifest_layout_and_random_transforms(self):
        manifest = os.path.join(self.root, "metadata.jsonl")
        with open(manifest, "w", encoding="utf-8") as f:
            for name in ("c.png", "a.png"):
                f.write(json.dumps({"file_name": os.path.join("images", name), "text": CAPTIONS[name]}) + "\n")
        common = ("--pipeline", self.pipeline, "--vae", "pixels", "--resolution", "32", "--dtype", "fp32")
        path = self.out("from-manifest")
        result = forge("--images", manifest, "--output", path, "--text-tokens", "24", *common)
        self.assertEqual(result.returncode, 0, result.stderr)
        with open(os.path.join(path, "captions.jsonl"), encoding="utf-8") as f:
            self.assertEqual([os.path.basename(json.loads(line)["image"]) for line in f], ["c.png", "a.png"])
        # Random crops and flips: the same seed gives the same latents, another seed others.
        latents = []
        for name, seed in (("random-1", "1"), ("random-1-again", "1"), ("random-2", "2")):
            path, _ = self.forge_cache(name, *common, "--crop", "random", "--random-flip", "--seed", seed)
            latents.append(load_cache(path)[1])
        for image in CAPTIONS:
            np.testing.assert_array_equal(latents[0][image][0], latents[1][image][0])
        self.assertTrue(any(not np.array_equal(latents[0][i][0], latents[2][i][0]) for i in CAPTIONS))

    def test_distribution_latents_and_empty_prompt_match_diffusers(self):
        """--latents distribution stores diffusers' latent_dist.mean and .logvar; both caches hold the
        empty caption's encodings (diffusers' encode_prompt(""), NOTE [FLUX caption dropout])."""
        from safetensors.numpy import load_file

        forge_path, _ = self.forge_cache("forge-distribution", "--pipeline", self.pipeline, "--resolution", "32",
                                         "--dtype", "fp32", "--latents", "distribution")
        reference = self.diffusers_cache("diffusers-distribution", "--resolution", "32", "--latents",
                                         "distribution")
        found = []
        for path in (forge_path, reference):
            with open(os.path.join(path, "cache.json")) as f:
                manifest = json.load(f)
            self.assertEqual(manifest["latents"], "distribution")
            self.assertEqual(manifest["scaling_factor"], 0.3611)
            self.assertEqual(manifest["shift_factor"], 0.1159)
            self.assertEqual(manifest["empty_prompt"], "empty-prompt.safetensors")
            shards = [load_file(os.path.join(path, s["file"])) for s in manifest["shards"]]
            for shard in shards:
                self.assertNotIn("latents", shard)
            samples = {}
            with open(os.path.join(path, "captions.jsonl"), encoding="utf-8") as f:
                for line in f:
                    row = json.loads(line)
                    samples[os.path.basename(row["image"])] = [
                        np.asarray(shards[row["shard"]][k][row["row"]], dtype=np.float64)
                        for k in ("latent_mean", "latent_logvar", "prompt_embeds", "pooled_prompt_embeds")]
            empty = load_file(os.path.join(path, "empty-prompt.safetensors"))
            found.append((samples, empty))
        (forge_samples, forge_empty), (reference_samples, reference_empty) = found
        self.assertEqual(set(forge_samples), set(CAPTIONS))
        for image, expected in reference_samples.items():
            for kind, got, want in zip(("mean", "logvar", "prompt_embeds", "pooled"), forge_samples[image],
                                       expected):
                self.assertEqual(got.shape, want.shape, f"{image} {kind}")
                self.assertLess(relative_error(got, want), TOLERANCE, f"{image} {kind}")
        for name in ("prompt_embeds", "pooled_prompt_embeds"):
            self.assertEqual(forge_empty[name].shape, reference_empty[name].shape, name)
            self.assertEqual(forge_empty[name].shape[0], 1, name)
            self.assertLess(relative_error(forge_empty[name].astype(np.float64),
                                           reference_empty[name].astype(np.float64)), TOLERANCE, name)
        # A mode cache holds the empty caption too, the same encodings.
        mode_path, _ = self.forge_cache("forge-mode-empty", "--pipeline", self.pipeline, "--vae", "pixels",
                                        "--resolution", "32", "--dtype", "fp32")
        mode_empty = load_file(os.path.join(mode_path, "empty-prompt.safetensors"))
        for name in ("prompt_embeds", "pooled_prompt_embeds"):
            np.testing.assert_array_equal(mode_empty[name], forge_empty[name], err_msg=name)
        # forge reads a distribution cache without noise as its mode, (mean - shift) * scale.
        read = self.out("read-distribution")
        os.makedirs(read)
        run([tool("forge_flux_cache_read"), forge_path, read])
        with open(os.path.join(forge_path, "captions.jsonl"), encoding="utf-8") as f:
            order = [os.path.basename(json.loads(line)["image"]) for line in f]
        got = np.fromfile(os.path.join(read, "latents.bin"), dtype=np.float32)
        want = np.concatenate([((forge_samples[i][0].astype(np.float32) - np.float32(0.1159)) *
                                np.float32(0.3611)).ravel() for i in order])
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        # Refusals.
        base = ("--images", self.images, "--pipeline", self.pipeline, "--resolution", "32", "--output",
                self.out("y"))
        for args, fragment in (((*base, "--latents", "sample"), "--latents 'sample'"),
                               ((*base, "--vae", "pixels", "--latents", "distribution"), "--vae pixels")):
            result = forge(*args)
            self.assertNotEqual(result.returncode, 0)
            self.assertIn(fragment, result.stdout + result.stderr)
        self.assertFalse(os.path.exists(self.out("y")))

    def test_cuda_matches_cpu(self):
        """On a machine with a GPU: the encoders in bf16 on CUDA against the CPU's fp32."""
        path = self.out("forge-cuda")
        result = forge("--images", self.images, "--output", path, "--text-tokens", "24", "--batch-size", "2",
                       "--pipeline", self.pipeline, "--resolution", "32", "--dtype", "fp32", "--device", "cuda")
        if "no GPU is visible" in result.stdout + result.stderr:
            self.skipTest("no GPU")
        self.assertEqual(result.returncode, 0, result.stderr)
        cpu, _ = self.forge_cache("forge-cuda-reference", "--pipeline", self.pipeline, "--resolution", "32",
                                  "--dtype", "fp32")
        _, on_gpu = load_cache(path)
        _, on_cpu = load_cache(cpu)
        for image in CAPTIONS:
            for kind, got, want in zip(("latents", "prompt_embeds", "pooled"), on_gpu[image], on_cpu[image]):
                self.assertLess(relative_error(got, want), 5e-2, f"{image} {kind}")

    def test_cuda_distribution_matches_cpu(self):
        """On a machine with a GPU: --latents distribution's moments and the empty caption in bf16 on CUDA
        against the CPU's fp32."""
        from safetensors.numpy import load_file

        args = ("--pipeline", self.pipeline, "--resolution", "32", "--dtype", "fp32", "--latents", "distribution")
        path = self.out("forge-cuda-distribution")
        result = forge("--images", self.images, "--output", path, "--text-tokens", "24", "--batch-size", "2",
                       "--device", "cuda", *args)
        if "no GPU is visible" in result.stdout + result.stderr:
            self.skipTest("no GPU")
        self.assertEqual(result.returncode, 0, result.stderr)
        cpu, _ = self.forge_cache("forge-cuda-distribution-reference", *args)
        for name in ("shard-00000.safetensors", "empty-prompt.safetensors"):
            on_gpu, on_cpu = load_file(os.path.join(path, name)), load_file(os.path.join(cpu, name))
            self.assertEqual(set(on_gpu), set(on_cpu))
            for key in on_cpu:
                self.assertLess(relative_error(on_gpu[key].astype(np.float64), on_cpu[key].astype(np.float64)),
                                5e-2, f"{name} {key}")

    def test_torchtitan_transform_and_min_size(self):
        # MLPerf's Flux.1 training data: bicubic, ceil, random crops, images under 30 skipped
        # (a.png 40x24 and c.png 24x48 here); their pixels are python.test_image_decode_vs_pil's.
        path, log = self.forge_cache("torchtitan", "--pipeline", self.pipeline, "--resolution", "32", "--vae",
                                     "pixels", "--transform", "torchtitan", "--min-size", "30", "--seed", "3",
                                     "--dtype", "fp32")
        with open(os.path.join(path, "cache.json")) as f:
            manifest = json.load(f)
        self.assertEqual(manifest["samples"], 3)
        source = manifest["source"]
        self.assertEqual((source["transform"], source["crop"], source["min_size"], source["skipped_too_small"]),
                         ("torchtitan", "random", 30, 2))
        self.assertIn("skipped 2 of 5 images under --min-size 30", log)
        with open(os.path.join(path, "captions.jsonl"), encoding="utf-8") as f:
            kept = sorted(os.path.basename(json.loads(line)["image"]) for line in f)
        self.assertEqual(kept, ["b.jpg", "d.jpg", "e.png"])
        # The pixel latents unfolded (NOTE [Pixel latents]) are the reference's tensor at one
        # of the crop offsets: exactly for the PNG; for the JPEGs within 3 levels (2 of JPEG
        # decoding, NOTE [JPEG decoding], and one more of the bicubic's overshoot).
        import test_image_decode_vs_pil as pil_tests

        _, samples = load_cache(path)
        for name in kept:
            latents = samples[name][0]
            pixels = np.zeros((3, 32, 32))
            for dy in range(2):
                for dx in range(2):
                    pixels[:, dy::2, dx::2] = latents[(dy * 2 + dx) * 4:(dy * 2 + dx) * 4 + 3]
            with Image.open(os.path.join(self.images, name)) as image:
                w, h = image.size
                spare = math.ceil(32 / min(w, h) * max(w, h)) - 32
                errors = [float(np.abs(pil_tests.process_cc12m_image(image, 32, False, offset) - pixels).max())
                          for offset in range(spare + 1)]
            self.assertLessEqual(min(errors), 0 if name.endswith(".png") else 6 / 255 + 1e-6, f"{name}: {errors}")
        base = ("--images", self.images, "--pipeline", self.pipeline, "--resolution", "32", "--output",
                self.out("never"))
        for args, fragment in [(("--transform", "mlperf"), "--transform 'mlperf'"),
                               (("--transform", "torchtitan", "--buckets", "32x48"), "one square bucket"),
                               (("--transform", "torchtitan", "--random-flip"), "--random-flip does not apply"),
                               (("--transform", "torchtitan", "--crop", "center"), "--crop does not apply"),
                               (("--min-size", "-1"), "--min-size -1"),
                               (("--min-size", "100"), "all 5 images are under --min-size 100")]:
            with self.subTest(args=args):
                result = forge(*base, *args)
                self.assertNotEqual(result.returncode, 0)
                self.assertIn(fragment, result.stdout + result.stderr)
        self.assertFalse(os.path.exists(self.out("never")))

    def test_refusals(self):
        p, images = self.pipeline, self.images
        base = ("--images", images, "--pipeline", p, "--resolution", "32")
        existing, _ = self.forge_cache("existing", "--pipeline", p, "--resolution", "32")
        before = sorted(os.listdir(existing))
        stranger = self.out("stranger")
        os.makedirs(stranger)
        with open(os.path.join(stranger, "notes.txt"), "w") as f:
            f.write("mine")
        cases = [
            (("--images", images, "--pipeline", p), "--output"),
            (("--images", self.out("nope"), "--output", self.out("x"), "--pipeline", p), "no such file"),
            (("--images", images, "--output", self.out("x")), "--vae is missing"),
            (("--images", images, "--pipeline", p, "--output", self.out("x"), "--resolution", "20"),
             "--resolution 20"),
            ((*base, "--output", self.out("x"), "--buckets", "32x30"), "32x30"),
            ((*base, "--output", self.out("x"), "--crop", "middle"), "--crop"),
            ((*base, "--output", self.out("x"), "--dtype", "fp16"), "--dtype"),
            ((*base, "--output", self.out("x"), "--device", "tpu"), "--device"),
            ((*base, "--output", self.out("x"), "--text-tokens", "0"), "--text-tokens"),
            ((*base, "--output", self.out("x"), "--batch-size", "0"), "--batch-size"),
            ((*base, "--output", self.out("x"), "--layout", "jsonl"), "jsonl"),
            ((*base, "--output", self.out("x"), "--layout", "tar"), "tar"),
            ((*base, "--output", self.out("x"), "--missing-captions", "maybe"), "--missing-captions"),
            ((*base, "--output", self.out("x"), "--vae", self.out("nope")), "--vae"),
            ((*base, "--output", self.out("x"), "--t5", os.path.join(p, "vae")), "vae/config.json"),
            ((*base, "--output", self.out("x"), "--tokenizer", "t.json"), "--tokenizer applies to text"),
            ((*base, "--output", existing), "--overwrite"),
            ((*base, "--output", stranger, "--overwrite"), "not a FLUX latent cache"),
            (("--input", "x.jsonl", "--tokenizer", "t.json", "--output-prefix", "o", "--vae", "pixels"),
             "--vae applies to --images"),
            (("--tokenizer", "t.json", "--output-prefix", "o"), "--input is required"),
        ]
        for args, fragment in cases:
            with self.subTest(args=args):
                result = forge(*args)
                self.assertNotEqual(result.returncode, 0)
                self.assertIn(fragment, result.stdout + result.stderr)
        self.assertFalse(os.path.exists(self.out("x")))
        self.assertEqual(sorted(os.listdir(existing)), before)
        self.assertEqual(os.listdir(stranger), ["notes.txt"])
        # A missing caption: an error, or skipped.
        missing = self.out("missing-images")
        shutil.copytree(images, missing)
        os.remove(os.path.join(missing, "c.txt"))
        result = forge("--images", missing, "--pipeline", p, "--resolution", "32", "--output", self.out("m"))
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("c.png", result.stdout + result.stderr)
        result = forge("--images", missing, "--pipeline", p, "--resolution", "32", "--output", self.out("m"),
                       "--missing-captions", "skip")
        self.assertEqual(result.returncode, 0, result.stderr)
        with open(os.path.join(self.out("m"), "cache.json")) as f:
            self.assertEqual(json.load(f)["samples"], 4)
        # --overwrite replaces a cache.
        result = forge(*base, "--output", existing, "--overwrite", "--vae", "pixels")
        self.assertEqual(result.returncode, 0, result.stderr)
        with open(os.path.join(existing, "cache.json")) as f:
            self.assertEqual(json.load(f)["autoencoder"], "pixels")


if __name__ == "__main__":
    unittest.main()
