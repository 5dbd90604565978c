#!/usr/bin/env python3
"""Writes a FLUX latent cache (NOTE [FLUX latent cache] in src/ckpt/flux_latent_cache.h) with
diffusers and transformers, so a forge FLUX run (flux.data_path) can train on latents and text
features made outside forge:

  python scripts/flux_cache_from_diffusers.py --images DATASET --pipeline /models/FLUX.1-dev \\
      --output DIR [--layout caption-files|filename-captions|jsonl] [--resolution 1024 | --buckets 1024x1024,...] \\
      [--text-tokens 512] [--dtype bf16|fp32] [--torch-dtype float32|bfloat16] [--device cpu|cuda] \\
      [--batch-size 4] [--shard-samples 256] [--vae pixels] [--latents mode|distribution] [--overwrite]

Per image, as diffusers' FLUX training scripts do: ImageOps.exif_transpose, convert("RGB"),
resize to cover the bucket with PIL's bilinear filter (torchvision's Resize of the shorter side
for a square bucket), center crop, ToTensor, Normalize([0.5], [0.5]); the bucket is the one
nearest in aspect ratio (the first on a tie). Latents: AutoencoderKL.encode(x).latent_dist.mode(),
then (z - shift_factor) * scaling_factor, or with --vae pixels forge's pixel fold (NOTE [Pixel
latents]); with --latents distribution, latent_dist.mean and latent_dist.logvar unscaled instead
(NOTE [FLUX posterior latents]: forge draws and scales a latent per use). Text: FluxPipeline.encode_prompt (T5's prompt_embeds of --text-tokens tokens, CLIP's
pooled_prompt_embeds), and once the empty caption's ("", empty-prompt.safetensors: NOTE [FLUX
caption dropout]). Samples are grouped by bucket in the buckets' order, images sorted by
path within the folder layouts (the manifest's order for jsonl), as forge prep --images orders
them. Random crops and flips are forge's own random numbers and are not offered here.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
from PIL import Image, ImageOps

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp")
FORMAT = "forge-flux-latent-cache"


def fail(message):
    print(f"flux_cache_from_diffusers: {message}", file=sys.stderr)
    sys.exit(1)


def list_images(folder):
    found = []
    for root, dirs, files in os.walk(folder, followlinks=False):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS):
                found.append(os.path.join(root, name))
    return sorted(found, key=lambda p: os.path.relpath(p, folder).encode("utf-8"))


def read_dataset(path, layout, extension, skip_missing):
    entries = []
    if layout == "jsonl":
        base = os.path.dirname(os.path.abspath(path))
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                image = row.get("image", row.get("file_name"))
                caption = row.get("text", row.get("caption"))
                if image is None:
                    fail(f"{path}:{number}: no \"image\"")
                if caption is None:
                    if skip_missing:
                        continue
                    fail(f"{path}:{number}: no \"text\"")
                entries.append((image if os.path.isabs(image) else os.path.join(base, image), caption))
        return entries
    for image in list_images(path):
        if layout == "filename-captions":
            entries.append((image, os.path.splitext(os.path.basename(image))[0].replace("_", " ")))
            continue
        caption_file = os.path.splitext(image)[0] + extension
        if not os.path.isfile(caption_file):
            if skip_missing:
                continue
            fail(f"{image}: no caption file {caption_file}")
        with open(caption_file, encoding="utf-8") as f:
            entries.append((image, f.read().lstrip("\ufeff").strip()))
    return entries


def parse_buckets(text):
    buckets = []
    for item in text.split(","):
        w, h = (int(v) for v in item.lower().split("x"))
        if w % 16 or h % 16 or not (16 <= w <= 16384 and 16 <= h <= 16384):
            fail(f"bucket {item}: sides must be multiples of 16 from 16 to 16384")
        buckets.append((w, h))
    return buckets


def nearest_bucket(width, height, buckets):
    def distance(bucket):
        a, c = width * bucket[1], height * bucket[0]
        return (max(a, c), min(a, c))

    best = 0
    for i in range(1, len(buckets)):
        hi, lo = distance(buckets[i])
        best_hi, best_lo = distance(buckets[best])
        if hi * best_lo < best_hi * lo:  # hi/lo < best_hi/best_lo, exactly
            best = i
    return best


def load_image(path, bucket):
    """The bucket-sized float32 [3, h, w] tensor in [-1, 1], as forge's center-cropped transform."""
    with Image.open(path) as opened:
        image = ImageOps.exif_transpose(opened).convert("RGB")
    w, h = bucket
    if image.width * h >= image.height * w:
        size = (h * image.width // image.height, h)
    else:
        size = (w, w * image.height // image.width)
    image = image.resize(size, Image.BILINEAR)
    left, top = int(round((size[0] - w) / 2.0)), int(round((size[1] - h) / 2.0))
    image = image.crop((left, top, left + w, top + h))
    x = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).float().div(255)
    return (x - 0.5) / 0.5


def pixel_latents(images):
    """NOTE [Pixel latents]: latent[b, (dy*2+dx)*4+c, y, x] = image[b, c, 2y+dy, 2x+dx], channel 3 zero."""
    b, _, h, w = images.shape
    padded = torch.cat([images, torch.zeros(b, 1, h, w, dtype=images.dtype)], dim=1)
    blocks = padded.reshape(b, 4, h // 2, 2, w // 2, 2).permute(0, 3, 5, 1, 2, 4)
    return blocks.reshape(b, 16, h // 2, w // 2)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--pipeline", required=True, help="a FluxPipeline folder (the transformer is not needed)")
    parser.add_argument("--layout", choices=["caption-files", "filename-captions", "jsonl"])
    parser.add_argument("--caption-extension", default=".txt")
    parser.add_argument("--missing-captions", choices=["error", "skip"], default="error")
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--buckets", help="WxH,...: default the square bucket of --resolution")
    parser.add_argument("--vae", choices=["pipeline", "pixels"], default="pipeline")
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--torch-dtype", choices=["float32", "bfloat16", "float64"], default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--shard-samples", type=int, default=256)
    parser.add_argument("--latents", choices=["mode", "distribution"], default="mode")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    if args.latents == "distribution" and args.vae == "pixels":
        fail("--latents distribution: --vae pixels has no posterior to sample")

    from diffusers import AutoencoderKL, FluxPipeline
    from safetensors.torch import save_file
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

    layout = args.layout or ("jsonl" if os.path.isfile(args.images) else "caption-files")
    if args.resolution % 16 or not 16 <= args.resolution <= 16384:
        fail(f"--resolution {args.resolution}: a multiple of 16 from 16 to 16384")
    buckets = parse_buckets(args.buckets) if args.buckets else [(args.resolution, args.resolution)]
    if os.path.exists(args.output):
        if not os.path.isfile(os.path.join(args.output, "cache.json")) or not args.overwrite:
            fail(f"{args.output} exists: give --overwrite to replace a cache (anything else is never replaced)")
    entries = read_dataset(args.images, layout, args.caption_extension, args.missing_captions == "skip")
    if not entries:
        fail(f"{args.images}: no images with captions")
    by_bucket = [[] for _ in buckets]
    for image, caption in entries:
        with Image.open(image) as opened:
            upright = ImageOps.exif_transpose(opened)
            by_bucket[nearest_bucket(upright.width, upright.height, buckets)].append((image, caption))

    dtype = getattr(torch, args.torch_dtype)
    device = torch.device(args.device)
    p = args.pipeline
    vae = None
    if args.vae == "pipeline":
        vae = AutoencoderKL.from_pretrained(p, subfolder="vae", torch_dtype=dtype).to(device).eval()
    pipe = FluxPipeline(
        scheduler=None,
        vae=vae,
        text_encoder=CLIPTextModel.from_pretrained(p, subfolder="text_encoder", torch_dtype=dtype).to(device).eval(),
        tokenizer=CLIPTokenizer.from_pretrained(p, subfolder="tokenizer"),
        text_encoder_2=T5EncoderModel.from_pretrained(p, subfolder="text_encoder_2", torch_dtype=dtype).to(device).eval(),
        tokenizer_2=T5TokenizerFast.from_pretrained(p, subfolder="tokenizer_2"),
        transformer=None,
    )
    stored = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    parent = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(parent, exist_ok=True)
    temporary = tempfile.mkdtemp(prefix=os.path.basename(args.output) + ".tmp-", dir=parent)
    try:
        shards, captions, latent_channels, context_dim, pooled_dim = [], [], 16, None, None
        for bucket, members in zip(buckets, by_bucket):
            for start in range(0, len(members), args.shard_samples):
                chunk = members[start:start + args.shard_samples]
                latents, logvars, texts, pooled = [], [], [], []
                for b in range(0, len(chunk), args.batch_size):
                    batch = chunk[b:b + args.batch_size]
                    images = torch.stack([load_image(image, bucket) for image, _ in batch])
                    with torch.no_grad():
                        if vae is None:
                            z = pixel_latents(images)
                        elif args.latents == "distribution":
                            posterior = vae.encode(images.to(device, dtype)).latent_dist
                            z = posterior.mean
                            logvars.append(posterior.logvar.float().cpu())
                            latent_channels = z.shape[1]
                        else:
                            z = vae.encode(images.to(device, dtype)).latent_dist.mode()
                            z = (z - vae.config.shift_factor) * vae.config.scaling_factor
                            latent_channels = z.shape[1]
                        prompt_embeds, pooled_embeds, _ = pipe.encode_prompt(
                            prompt=[c for _, c in batch], prompt_2=None, device=device,
                            max_sequence_length=args.text_tokens)
                    latents.append(z.float().cpu())
                    texts.append(prompt_embeds.float().cpu())
                    pooled.append(pooled_embeds.float().cpu())
                context_dim, pooled_dim = texts[0].shape[2], pooled[0].shape[1]
                name = f"shard-{len(shards):05d}.safetensors"
                tensors = {"prompt_embeds": torch.cat(texts).to(stored).contiguous(),
                           "pooled_prompt_embeds": torch.cat(pooled).to(stored).contiguous()}
                if logvars:
                    tensors["latent_mean"] = torch.cat(latents).to(stored).contiguous()
                    tensors["latent_logvar"] = torch.cat(logvars).to(stored).contiguous()
                else:
                    tensors["latents"] = torch.cat(latents).to(stored).contiguous()
                save_file(tensors, os.path.join(temporary, name), metadata={"format": FORMAT})
                for row, (image, caption) in enumerate(chunk):
                    captions.append({"shard": len(shards), "row": row, "image": image, "caption": caption})
                shards.append({"file": name, "samples": len(chunk), "width": bucket[0], "height": bucket[1]})
        with torch.no_grad():
            empty_embeds, empty_pooled, _ = pipe.encode_prompt(prompt=[""], prompt_2=None, device=device,
                                                               max_sequence_length=args.text_tokens)
        save_file({"prompt_embeds": empty_embeds.float().cpu().to(stored).contiguous(),
                   "pooled_prompt_embeds": empty_pooled.float().cpu().to(stored).contiguous()},
                  os.path.join(temporary, "empty-prompt.safetensors"), metadata={"format": FORMAT})
        with open(os.path.join(temporary, "captions.jsonl"), "w", encoding="utf-8") as f:
            for line in captions:
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
        manifest = {"format": FORMAT, "version": 1, "autoencoder": "pixels" if vae is None else "vae",
                    "latent_channels": latent_channels, "text_tokens": args.text_tokens, "context_dim": context_dim,
                    "pooled_dim": pooled_dim, "dtype": args.dtype, "empty_prompt": "empty-prompt.safetensors",
                    "samples": len(captions), "shards": shards,
                    "source": {"tool": "scripts/flux_cache_from_diffusers.py", "dataset": args.images,
                               "layout": layout, "buckets": [f"{w}x{h}" for w, h in buckets], "crop": "center",
                               "pipeline": p, "torch_dtype": args.torch_dtype, "device": args.device}}
        if args.latents == "distribution":
            manifest.update({"latents": "distribution", "scaling_factor": vae.config.scaling_factor,
                             "shift_factor": vae.config.shift_factor})
        with open(os.path.join(temporary, "cache.json"), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)
        if os.path.exists(args.output):
            shutil.rmtree(args.output)
        os.rename(temporary, args.output)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    print(f"wrote {len(captions)} samples in {len(shards)} shards to {args.output}")


if __name__ == "__main__":
    main()
