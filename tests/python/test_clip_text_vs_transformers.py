"""forge's CLIP text encoder and CLIP tokenizer against transformers' CLIPTextModel and
CLIPTokenizer (NOTE [CLIP text encoder], NOTE [CLIP tokenizer]).

Encoder: tiny random configs (2 to 4 heads, 1 to 3 layers, quick_gelu, gelu, gelu_new and
gelu_pytorch_tanh, the legacy and the eos_token_id pooling rule, batches of several padded
captions, captions shorter than max_position_embeddings) saved in every layout forge reads
(transformers 5's save_pretrained, sharded; transformers 4's "text_model." names with the
position_ids buffer, in bf16; a lone fp16 .safetensors file; a pipeline folder holding
text_encoder/). tools/forge_clip_reference loads each and runs the CPU encoder in fp32;
transformers' model runs in float64 on the very values the file holds. The last hidden state
and the pooled output must agree within 1e-4 relative error (max |diff| / max |reference|).

Tokenizer: vocab.json / merges.txt made as OpenAI's are, with merges trained by tokenizers on
CLIP's pipeline (clip_fixtures.py): a small one from captions, and a larger one (6000
tokens) from the World English Bible in data/corpora; the tokenizer_config.json and
special_tokens_map.json layouts published CLIP tokenizers use, a tokenizer.json written by
transformers, a pipeline folder. forge's ids without specials must equal
tokenizer(text, add_special_tokens=False), and its padded ids FluxPipeline's call
(padding="max_length", max_length=77, truncation=True), token for token, on captions with
punctuation, digits, contractions, whitespace of every kind, composed and decomposed
accents, combining marks in every order, Hangul, special tokens in the text, long captions
that get truncated, and the empty string; and on every Unicode code point (NFC, Lowercase and
the split through the whole pipeline).
"""
import json
import os
import random
import shutil
import sys
import unittest

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import clip_fixtures as fixtures  # noqa: E402
from forge_test_util import relative_error, run, scratch_dir, source_dir, tool  # noqa: E402

TOLERANCE = 1e-4
CLIP_LENGTH = 77

MODEL_BASE = dict(vocab=64, hidden=32, intermediate=48, layers=2, heads=2, positions=9, act="quick_gelu", eps=1e-5,
                  eos=2, batch=3, seq=9, layout="save_pretrained", dtype="float32")
MODEL_CASES = [
    dict(MODEL_BASE, name="legacy_pooling_quick_gelu"),
    dict(MODEL_BASE, name="eos_pooling_gelu_v4_bf16", act="gelu", heads=4, layers=3, eos=57, batch=5,
         layout="text_model_prefix", dtype="bfloat16"),
    dict(MODEL_BASE, name="gelu_new_short_captions_sharded", act="gelu_new", layers=1, positions=11, seq=6,
         layout="sharded"),
    dict(MODEL_BASE, name="pytorch_tanh_lone_fp16_file", act="gelu_pytorch_tanh", eps=1e-6, hidden=48, heads=3,
         intermediate=40, batch=2, layout="lone_file", dtype="float16"),
    dict(MODEL_BASE, name="pipeline_folder", eos=61, layout="pipeline", batch=2),
]


def random_model(c):
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["intermediate"],
                            num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                            max_position_embeddings=c["positions"], hidden_act=c["act"], layer_norm_eps=c["eps"],
                            eos_token_id=c["eos"], bos_token_id=c["vocab"] - 2, pad_token_id=1)
    torch.manual_seed(len(c["name"]))
    model = CLIPTextModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embedding" in name:
                p.normal_(0.0, 0.5)
            elif p.ndim == 2:
                p.normal_(0.0, 0.7 / p.shape[1] ** 0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
            # The values the file will hold, so that the reference computes with them.
            p.copy_(p.to(getattr(torch, c["dtype"])).float())
    return model


def save(model, c, directory):
    """Writes the model in the case's layout; returns the path forge is given."""
    from safetensors.torch import save_file

    dtype = getattr(torch, c["dtype"])
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    if c["layout"] == "save_pretrained":
        model.save_pretrained(directory)
        return directory
    if c["layout"] == "sharded":
        model.save_pretrained(directory, max_shard_size="20KB")
        assert os.path.exists(os.path.join(directory, "model.safetensors.index.json"))
        return directory
    if c["layout"] == "pipeline":
        model.save_pretrained(os.path.join(directory, "text_encoder"))
        return directory
    os.makedirs(directory, exist_ok=True)
    model.config.to_json_file(os.path.join(directory, "config.json"))
    if c["layout"] == "text_model_prefix":
        state = {"text_model." + k: v for k, v in state.items()}
        state["text_model.embeddings.position_ids"] = torch.arange(c["positions"]).unsqueeze(0)
        save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        return directory
    assert c["layout"] == "lone_file"
    path = os.path.join(directory, "clip_text.safetensors")
    save_file(state, path, metadata={"format": "pt"})
    return path


def caption_rows(c, rng):
    """Token rows as CLIP's tokenizer makes them (bos, words, eos, padding), and rows that
    test the pooling rule's corners."""
    v, seq = c["vocab"], c["seq"]
    bos = v - 2
    eos = v - 1 if c["eos"] == 2 else c["eos"]
    pad = eos if c["eos"] == 2 else 0
    words = [i for i in range(3, v - 2) if i != eos]
    rows = []
    for b in range(c["batch"]):
        n = [seq - 2, 0, 1, 3, seq // 2][b % 5]
        row = [bos] + [int(rng.choice(words)) for _ in range(n)] + [eos]
        rows.append((row + [pad] * seq)[:seq])
    if c["eos"] != 2 and c["batch"] >= 5:
        rows[3] = [int(rng.choice(words)) for _ in range(seq)]            # no eos: transformers pools position 0
        rows[4] = [bos, eos] + [int(rng.choice(words)) for _ in range(seq - 3)] + [eos]  # the first eos is pooled
    return rows


class ClipTextEncoderVsTransformers(unittest.TestCase):
    def check(self, c):
        d = scratch_dir()
        model = random_model(c)
        path = save(model, c, os.path.join(d, "model"))
        rows = caption_rows(c, np.random.RandomState(len(c["name"])))
        with open(os.path.join(d, "tokens.json"), "w") as f:
            json.dump({"batch": len(rows), "seq": c["seq"], "ids": [i for row in rows for i in row]}, f)
        run([tool("forge_clip_reference"), "encode", path, d])
        b, s, h = len(rows), c["seq"], c["hidden"]
        last = np.fromfile(os.path.join(d, "last_hidden.bin"), dtype=np.float32).reshape(b, s, h)
        pooled = np.fromfile(os.path.join(d, "pooled.bin"), dtype=np.float32).reshape(b, h)

        reference = model.double().eval()
        reference.config._attn_implementation = "eager"
        with torch.no_grad():
            out = reference(input_ids=torch.tensor(rows, dtype=torch.long))
        self.assertLess(relative_error(last, out.last_hidden_state.numpy()), TOLERANCE, "last hidden state")
        self.assertLess(relative_error(pooled, out.pooler_output.numpy()), TOLERANCE, "pooled output")

    def test_cases(self):
        for c in MODEL_CASES:
            with self.subTest(c["name"]):
                self.check(c)

    def test_refuses_a_text_model_with_projection(self):
        from transformers import CLIPTextConfig, CLIPTextModelWithProjection

        d = scratch_dir()
        config = CLIPTextConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                num_attention_heads=2, max_position_embeddings=8, projection_dim=8)
        CLIPTextModelWithProjection(config).save_pretrained(d)
        with open(os.path.join(d, "tokens.json"), "w") as f:
            json.dump({"batch": 1, "seq": 8, "ids": [0] * 8}, f)
        result = run_failing([tool("forge_clip_reference"), "encode", d, d])
        self.assertIn("config.json", result)
        self.assertIn("architectures", result)
        self.assertIn("CLIPTextModelWithProjection", result)


def run_failing(args):
    import subprocess

    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode == 0:
        raise AssertionError(f"{args} succeeded, expected a refusal")
    return result.stderr


# ---------------------------------------------------------------------------------------- tokenizer

CAPTIONS = [
    "", " ", "\t\n ", "a photo of a cat", "A PHOTO OF A CAT!!", "  leading and trailing spaces  ",
    "It's a dog's life, isn't it? We're sure they'll go; I'd say I'm fine, you've seen. IT'S LOUD'S",
    "'s 'S ''quoted'' \"double\" `tick` can't won't y'all rock'n'roll",
    "Price: $1,299.99 (was $1500) -- 50% off!!! #deal @shop_42 a+b=c <tag> [x] {y} ~z ^ | \\ /",
    "3.14159 2024-06-01 10:30pm 1st 2nd 3rd 100000000 ½ ² ³ ٣ ௫ Ⅻ",
    "café Café CAFÉ cafe\u0301 Cafe\u0301 CAFE\u0301 naïve nai\u0308ve façade fac\u0327ade résumé",
    "Straße STRASSE ẞ ΟΔΥΣΣΕΥΣ ὈΔΥΣΣΕΎΣ İstanbul ıi ǅ ǈ Ǳ",
    "x\u0323\u0307 x\u0307\u0323 q\u0307\u0323 \u1e0b\u0323 \u1e0d\u0307 a\u0328\u0301 \u212b \u2126 \u0344 \u0340",
    "東京タワーの夜景、とても綺麗。 한국어 문장입니다 \u1100\u1161\u11a8 \u1112\u1173\u11af \uac00\u11a8",
    "Привет, мир! مرحبا بالعالم שלום עולם नमस्ते दुनिया สวัสดีชาวโลก",
    "emoji 🐱‍👤 👍🏽 ❤️ 🇫🇷 🏳️‍🌈 ✨✨",
    "ﬁne ﬂow ＡＢＣ１２３ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛 ⓐⓑⓒ",
    "tabs\tand\nnewlines\r\n and  double  spaces\u00a0nbsp\u3000ideographic\u2028line\u2029para\u0085nel"
    "\u180emongolian",
    "zero\u200bwidth\u200djoiner\ufeffbom soft\u00adhyphen \x00control\x07chars\x1b[0m",
    "<|startoftext|>hello<|endoftext|>", "<|STARTOFTEXT|> upper specials <|ENDOFTEXT|>", "a<|endoftext|>b",
    "<|endoftext", "<|startoftext|><|startoftext|>", "<| endoftext |>",
    "a highly detailed photograph of an astronaut riding a horse on mars, trending on artstation, 8k, "
    "octane render, volumetric lighting, by greg rutkowski and alphonse mucha, masterpiece, best quality, "
    "ultra-detailed, cinematic composition, golden hour, bokeh, sharp focus, intricate, elegant",
    " ".join(["word"] * 120),
    "1234567890" * 12,
    "!" * 200,
]


def mark_soup(rng, count):
    """Starters, marks of many classes, composable pairs and Hangul jamo in random orders."""
    pool = (list("aeouAEOUnNcCsSzZ") + ["\u03a9", "\u03c9", "\u0391", "\u1100", "\u1161", "\u11a8", "\uac00",
                                        "\u0b47", "\u0b3e", "\u0b57", "\u09c7", "\u09be", "\u0915", "\u093c"]
            + ["\u0300", "\u0301", "\u0302", "\u0303", "\u0308", "\u030a", "\u030c", "\u0323", "\u0327",
               "\u0328", "\u0331", "\u0334", "\u0338", "\u0345", "\u05b0", "\u05bc", "\u0f71", "\u0f72",
               "\u0f74", "\u0f39", "\u1dc0", "\u302a", "\u0903", "\u0344", "\u0340", "\u212b", "\u1e9b",
               "\u0342", "\u0313", "\u0314", "\u0306", "\u0304", "\u1dfa", "\U0001e4ec", "\u0897"])
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 12))) for _ in range(count)]


def all_code_point_captions():
    """Every Unicode scalar value, 997 to a caption, each caption once as it is and once
    with spaces between its characters (so the split sees every character alone too)."""
    values = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    chunks = ["".join(map(chr, values[i:i + 997])) for i in range(0, len(values), 997)]
    return chunks + [" ".join(chunk[::7]) for chunk in chunks]


def bible_lines(limit):
    import zstandard

    path = os.path.join(source_dir(), "data", "corpora", "web-bible", "web-bible.jsonl.zst")
    with open(path, "rb") as f:
        text = zstandard.ZstdDecompressor().stream_reader(f).read().decode("utf-8")
    lines = []
    for record in text.splitlines():
        lines += [line for line in json.loads(record)["text"].split("\n") if line.strip()]
    return lines[:limit]


class ClipTokenizerVsTransformers(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.directory = scratch_dir()
        small_corpus = CAPTIONS[3:] * 3 + mark_soup(random.Random(1), 300)
        cls.small_merges = fixtures.train_merges(small_corpus, 900)
        cls.bible = bible_lines(20000)
        cls.bible_merges = fixtures.train_merges(cls.bible, 6000)

    def folder(self, name, merges, config=None, special_map=None):
        d = os.path.join(self.directory, name)
        shutil.rmtree(d, ignore_errors=True)
        vocab = fixtures.write_vocab_and_merges(d, merges)
        if config is not None:
            fixtures.write_json(os.path.join(d, "tokenizer_config.json"), config(vocab) if callable(config) else config)
        if special_map is not None:
            fixtures.write_json(os.path.join(d, "special_tokens_map.json"), special_map)
        return d

    def compare(self, path, captions, reference_path=None):
        from transformers import CLIPTokenizer

        reference = CLIPTokenizer.from_pretrained(reference_path or path)
        d = scratch_dir()
        fixtures.write_json(os.path.join(d, "captions.json"), captions)
        run([tool("forge_clip_reference"), "tokenize", path, d, str(CLIP_LENGTH)])
        with open(os.path.join(d, "ids.json")) as f:
            forge = json.load(f)
        expected = reference(captions, add_special_tokens=False).input_ids
        padded = reference(captions, padding="max_length", max_length=CLIP_LENGTH, truncation=True).input_ids
        self.assertEqual((len(forge["encode"]), len(forge["padded"])), (len(captions), len(captions)))
        self.assertEqual((forge["bos"], forge["eos"], forge["pad"]),
                         (reference.bos_token_id, reference.eos_token_id, reference.pad_token_id))
        for caption, got, want in zip(captions, forge["encode"], expected):
            self.assertEqual(got, want, repr(caption[:200]))
        for caption, got, want in zip(captions, forge["padded"], padded):
            self.assertEqual(got, want, repr(caption[:200]))
        return sum(len(ids) for ids in expected)

    def test_special_token_layouts(self):
        soup = mark_soup(random.Random(2), 2000)
        layouts = {
            "bare": dict(),
            "flux": dict(config=fixtures.flux_tokenizer_config, special_map=fixtures.flux_special_tokens_map()),
            "legacy_dicts": dict(config=fixtures.legacy_tokenizer_config(),
                                 special_map=fixtures.flux_special_tokens_map()),
            "special_map_only": dict(special_map=fixtures.flux_special_tokens_map()),
            "pad_bang": dict(config=lambda vocab: dict(fixtures.flux_tokenizer_config(vocab), pad_token="!")),
            "rstrip_lstrip": dict(config=lambda vocab: {
                "added_tokens_decoder": {str(vocab[fixtures.END]): {"content": fixtures.END, "lstrip": True,
                                                                    "rstrip": True, "normalized": False,
                                                                    "single_word": False, "special": True}}}),
        }
        for name, layout in layouts.items():
            with self.subTest(name):
                path = self.folder(name, self.small_merges, **layout)
                self.compare(path, CAPTIONS + soup)

    def test_tokenizer_json_written_by_transformers(self):
        from transformers import CLIPTokenizer

        source = self.folder("flux_source", self.small_merges, config=fixtures.flux_tokenizer_config,
                             special_map=fixtures.flux_special_tokens_map())
        saved = os.path.join(self.directory, "saved")
        CLIPTokenizer.from_pretrained(source).save_pretrained(saved)
        self.assertTrue(os.path.exists(os.path.join(saved, "tokenizer.json")))
        for name in ("vocab.json", "merges.txt"):  # forge must take vocab and merges from tokenizer.json
            if os.path.exists(os.path.join(saved, name)):
                os.remove(os.path.join(saved, name))
        self.compare(saved, CAPTIONS)
        json_only = os.path.join(self.directory, "json_only")
        os.makedirs(json_only, exist_ok=True)
        shutil.copy(os.path.join(saved, "tokenizer.json"), json_only)
        self.compare(json_only, CAPTIONS)

    def test_pipeline_folder(self):
        pipeline = os.path.join(self.directory, "pipeline")
        self.folder(os.path.join("pipeline", "tokenizer"), self.small_merges, config=fixtures.flux_tokenizer_config)
        self.compare(pipeline, CAPTIONS[:8], reference_path=os.path.join(pipeline, "tokenizer"))

    def test_every_code_point(self):
        path = self.folder("every_code_point", self.small_merges, config=fixtures.flux_tokenizer_config)
        self.assertGreater(self.compare(path, all_code_point_captions()), 3_000_000)

    def test_realistic_vocabulary(self):
        path = self.folder("bible", self.bible_merges, config=fixtures.flux_tokenizer_config,
                           special_map=fixtures.flux_special_tokens_map())
        with open(os.path.join(path, "vocab.json"), encoding="utf-8") as f:
            self.assertGreater(len(json.load(f)), 5000)
        self.compare(path, CAPTIONS + self.bible[::7] + mark_soup(random.Random(3), 500))


if __name__ == "__main__":
    unittest.main()
