#!/usr/bin/env python3
"""The coloured-shapes demonstration of issue 22 (README, FLUX.1): a FLUX-architecture model
(flux-small) trained from scratch by forge on small images of one red, green or blue circle,
square or triangle with captions naming them, then sampled by forge for every caption. It
prints the training and validation losses and how many samples show the colour and the
shape their caption asks for, and writes the samples and a grid of them as PNGs.

    python3 scripts/flux_shapes_demo.py --out /tmp/shapes [--device cuda] [--steps 1500]

Steps, each a forge command the script prints before running it:
  1. images: 32x32 PNGs with .txt captions (scripts/flux_shapes.py), a training and a
     validation set;
  2. text encoders: tiny random T5 and CLIP models with tokenizers trained on a corpus, in a
     FluxPipeline folder (the captions' features are fixed random functions of the words,
     which is all the demonstration needs from them); needs torch, transformers,
     sentencepiece and tokenizers;
  3. forge prep --images ... --vae pixels: latent caches (NOTE [Pixel latents]: the images'
     own pixels, folded, so the samples are the transformer's output with no decoder in
     between);
  4. forge train configs/experiments/cpu/flux-shapes.yaml with flux.data_path and
     flux.eval_data_path: the loss and the validation loss (NOTE [FLUX validation loss]);
  5. forge sample --vae pixels: images_per_caption samples of each of the 9 captions, then
     flux_shapes.classify() on each.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(ROOT, "tests", "python")]
import flux_shapes  # noqa: E402


def run(cmd, log):
    print("+ " + " ".join(cmd), flush=True)
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True)
    with open(log, "w") as f:
        f.write(result.stdout + result.stderr)
    if result.returncode != 0:
        sys.exit(f"failed ({result.returncode}), see {log}:\n{(result.stdout + result.stderr)[-3000:]}")
    print(f"  {time.time() - start:.1f} s, log {log}", flush=True)
    return result.stdout + result.stderr


def make_text_encoders(folder, captions):
    """tokenizer/, text_encoder/ (CLIP, hidden 16 = flux-small's pooled_dim), tokenizer_2/,
    text_encoder_2/ (T5, d_model 32 = flux-small's context_dim), random weights, seed 0."""
    import clip_fixtures
    import sentencepiece_fixtures
    from flux_fixtures import randomize
    import tokenizer_fixtures
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel, T5TokenizerFast

    corpus = tokenizer_fixtures.corpus(400) + captions * 20
    tokenizer = os.path.join(folder, "tokenizer")
    vocab = clip_fixtures.write_vocab_and_merges(tokenizer, clip_fixtures.train_merges(corpus, 400))
    clip_fixtures.write_json(os.path.join(tokenizer, "tokenizer_config.json"), clip_fixtures.flux_tokenizer_config(vocab))
    clip_fixtures.write_json(os.path.join(tokenizer, "special_tokens_map.json"), clip_fixtures.flux_special_tokens_map())
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
                                        hidden_act="quick_gelu", eos_token_id=2, bos_token_id=len(vocab) - 2,
                                        pad_token_id=1))
    randomize(clip, 1).save_pretrained(os.path.join(folder, "text_encoder"))

    spiece = os.path.join(folder, "spiece-source")
    os.makedirs(spiece)
    sentencepiece_fixtures.train("spiece", dict(model_type="unigram", vocab_size=300, pad_id=0, eos_id=1, unk_id=2,
                                                bos_id=-1), spiece, corpus)
    t5_tokenizer = T5TokenizerFast(vocab_file=os.path.join(spiece, "spiece.model"))
    t5_tokenizer.save_pretrained(os.path.join(folder, "tokenizer_2"))
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tokenizer), d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2,
                                 feed_forward_proj="gated-gelu", dropout_rate=0.0))
    randomize(t5, 2).save_pretrained(os.path.join(folder, "text_encoder_2"))


def write_grid(path, rows, pad=2):
    """rows: lists of equally sized images (rows of (r, g, b)); a white-padded grid PNG."""
    size = len(rows[0][0])
    width = max(len(r) for r in rows) * (size + pad) + pad
    grid = [[(255, 255, 255)] * width for _ in range(len(rows) * (size + pad) + pad)]
    for i, row in enumerate(rows):
        for j, image in enumerate(row):
            for y in range(size):
                grid[pad + i * (size + pad) + y][pad + j * (size + pad):pad + j * (size + pad) + size] = image[y]
    flux_shapes.write_png(path, grid)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="a new folder for everything the demonstration writes")
    p.add_argument("--forge", default=os.path.join(ROOT, "build", "forge"), help="the forge binary")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--per-class", type=int, default=200, help="training images per caption")
    p.add_argument("--images-per-caption", type=int, default=4)
    p.add_argument("--sample-steps", type=int, default=28)
    args = p.parse_args(argv)
    if os.path.exists(args.out):
        sys.exit(f"--out {args.out} exists; give a new folder")
    os.makedirs(args.out)
    out = lambda *names: os.path.join(args.out, *names)  # noqa: E731

    captions = flux_shapes.make_dataset(out("images", "train"), per_class=args.per_class, seed=0)
    flux_shapes.make_dataset(out("images", "validation"), per_class=4, seed=1)
    print(f"images: {9 * args.per_class} training and 36 validation images of 9 captions in {out('images')}")
    make_text_encoders(out("encoders"), captions)
    for split in ("train", "validation"):
        run([args.forge, "prep", "--images", out("images", split), "--layout", "caption-files", "--pipeline",
             out("encoders"), "--vae", "pixels", "--resolution", "32", "--text-tokens", "8", "--dtype", "fp32",
             "--device", args.device, "--output", out("cache", split)], out(f"prep-{split}.log"))
    cuda = ["--precision.compute_dtype", "bf16"] if args.device == "cuda" else []
    log = run([args.forge, "train", os.path.join(ROOT, "configs", "experiments", "cpu", "flux-shapes.yaml"),
               "--training.device", args.device, *cuda, "--training.steps", str(args.steps),
               "--flux.data_path", out("cache", "train"), "--flux.eval_data_path", out("cache", "validation"),
               "--eval.interval", "500",
               "--logging.run_dir", out("run")], out("train.log"))
    losses = [float(m) for m in re.findall(r"step +\d+ \| loss ([0-9.]+)", log)]
    evals = [float(m) for m in re.findall(r"validation loss ([0-9.]+)", log)]
    prompts = [a for c in captions for a in ("--prompt", c)]
    run([args.forge, "sample", "--transformer", out("run", "diffusers"), "--pipeline", out("encoders"), "--vae",
         "pixels", *prompts, "--images-per-prompt", str(args.images_per_caption), "--width", "32", "--height", "32",
         "--text-tokens", "8", "--steps", str(args.sample_steps), "--guidance", "1.0", "--seed", "5",
         "--device", args.device, "--batch-size", "4", "--output", out("samples")], out("sample.log"))
    files = sorted(f for f in os.listdir(out("samples")) if f.endswith(".png"))
    colour_hits = shape_hits = 0
    rows, per_caption = [], {}
    for f in files:
        image = flux_shapes.read_png(out("samples", f))
        caption = next(c for c in captions if f.split("-", 1)[1].startswith(c.replace(" ", "-")))
        colour, shape = flux_shapes.classify(image)
        want_colour, want_shape = caption.split()[1:]
        colour_hits += colour == want_colour
        shape_hits += shape == want_shape
        per_caption.setdefault(caption, []).append((image, colour, shape))
    for caption in captions:
        rows.append([image for image, _, _ in per_caption.get(caption, [])])
    write_grid(out("samples-grid.png"), rows)
    n = len(files)
    summary = {"device": args.device, "steps": args.steps, "first_loss": losses[0] if losses else None,
               "last_loss": losses[-1] if losses else None, "validation_losses": evals, "samples": n,
               "colour_correct": colour_hits, "shape_correct": shape_hits,
               "by_caption": {c: [f"{col} {shp}" for _, col, shp in v] for c, v in per_caption.items()}}
    with open(out("summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"loss {summary['first_loss']} -> {summary['last_loss']} over {args.steps} steps; validation loss "
          f"{' -> '.join(f'{v:.4f}' for v in evals)}")
    for c, v in summary["by_caption"].items():
        print(f"  {c:16s}: {', '.join(v)}")
    print(f"samples showing their caption's colour: {colour_hits}/{n}, shape: {shape_hits}/{n}; grid "
          f"{out('samples-grid.png')}")
    return summary


if __name__ == "__main__":
    main()
