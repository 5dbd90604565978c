"""Tokenizer files for the tokenizer tests, trained with the reference libraries themselves
(Hugging Face `tokenizers`, `sentencepiece`) on a generated multilingual corpus, and the
varied texts they are compared on. Shared by test_tokenizer_vs_hf.py,
test_tiktoken_vs_hf.py and scripts/bench-tokenizer."""
import base64
import copy
import json
import os
import random

LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]

WORDS = {
    "latin": "the quick brown fox jumps over lazy dog tokenizer training model data café naïve façade "
    "über Straße élève garçon año mañana déjà señor Ångström smörgåsbord".split(),
    "cyrillic": "привет мир как дела ёжик в тумане язык модель обучение данные".split(),
    "greek": "γειά σου κόσμε αλφάβητο λόγος μάθηση δεδομένα".split(),
    "chinese": "中文 测试 你好 世界 机器 学习 语言 模型 数据 训练".split(),
    "japanese": "日本語 テキスト カタカナ ひらがな 東京 学習 データ".split(),
    "arabic": "مرحبا بالعالم كيف حالك اللغة نموذج بيانات".split(),
    "hindi": "नमस्ते दुनिया आप कैसे हैं भाषा मॉडल डेटा".split(),
    "code": "def return import class self None True for in if else while x = y + 1 ( ) [ ] { } :".split(),
    "emoji": "😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🚀 ✨".split(),
    "contractions": "it's don't we're they've I'm we'll he'd IT'S Don'T".split(),
}

TEST_TEXTS = [
    "",
    "Hello world",
    "Héllo wörld, ça va? Ünïcödé façade naïve Ångström",
    "Привет, как дела? Ёжик в тумане.",
    "Γειά σου Κόσμε· αβγ ΑΒΓ",
    "中文测试，你好世界。机器学习很有趣！",
    "日本語のテキスト、カタカナとひらがな。東京タワー",
    "مرحبا بالعالم، كيف حالك؟",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🏳️‍🌈 heart ❤️ rocket🚀",
    "   multiple   spaces\t\ttabs\n\nnewlines\r\n  \n  end",
    "1234567890 12 123 1234 12345 3.14159 1,000,000 x2y22z333",
    "def f(x):\n    return x**2 + 1  # comment\n\n\tif x: pass\n",
    "it's don't we're they've I'm we'll he'd IT'S DON'T THEY'RE",
    "<|begin_of_text|>Hello<|end_of_text|> text <|eot_id|>more",
    "<|begin_of_text|><|begin_of_text|> <|eot_id|>\n",
    "forge is a forge word but forged and reforge and _forge are not; forge.",
    "a [TAB]  b   [TAB]c",
    "  leading spaces",
    "trailing spaces   ",
    " ",
    "\n",
    "\u00a0nbsp\u3000ideographic\u2009thin space\u0085next line\u2028separator",
    "a" * 300,
    "mixed中文and English123abc日本語",
    '{"json": [1, 2, 3], "key": null, "nested": {"a": "b"}}',
    "<html><body class='x'>Text &amp; more</body></html>",
    "rare characters: ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ᚠᛇᚻ ⅷ ½ ² ∑∫√ 𓀀",
    "<s> sentencepiece special tokens </s> <unk>",
]

INVALID_UTF8_TEXTS = [b"abc\xff\xfedef", b"\xc3(", b"ok \xe2\x82 cut", b"\xf0\x9f\x98 emoji cut", b"\x80"]


def corpus(lines=3000, seed=0):
    rng = random.Random(seed)
    groups = list(WORDS.values())
    out = []
    for _ in range(lines):
        group = rng.choice(groups)
        words = [rng.choice(group if rng.random() < 0.8 else rng.choice(groups)) for _ in range(rng.randint(3, 15))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 10**rng.randint(1, 7))))
        sep = rng.choice([" ", " ", " ", "  ", "\t", "\n"])
        out.append(sep.join(words) + rng.choice([".", ",", "!", "?", "", "\n"]))
    return out


def save_json(config, path):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False)
    return path


def train_byte_level(directory, lines=None):
    """Llama 3 layout: Split(Llama 3 regex, Isolated) + ByteLevel(use_regex=false),
    ignore_merges, special tokens, BOS in a TemplateProcessing post-processor, plus two
    non-special added tokens with single_word and lstrip/rstrip. Trained on `lines`
    (default corpus())."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=LLAMA3_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines or corpus(), trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]),
    ])
    tok.add_tokens([AddedToken("forge", single_word=True), AddedToken("[TAB]", lstrip=True, rstrip=True)])
    config = json.loads(tok.to_str())
    config["model"]["ignore_merges"] = True
    return save_json(config, os.path.join(directory, "llama3-style.json"))


def byte_level_variants(path, directory):
    """Same vocab and merges with other options: "a b" merge strings, ignore_merges off,
    GPT-2's ByteLevel pre-tokenizer with its own regex and add_prefix_space."""
    with open(path, encoding="utf-8") as f:
        base = json.load(f)
    variants = {}
    string_merges = copy.deepcopy(base)
    string_merges["model"]["merges"] = [" ".join(m) for m in base["model"]["merges"]]
    variants["string-merges"] = string_merges
    no_ignore = copy.deepcopy(base)
    no_ignore["model"]["ignore_merges"] = False
    variants["no-ignore-merges"] = no_ignore
    gpt2 = copy.deepcopy(base)
    gpt2["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    variants["gpt2-prefix-space"] = gpt2
    digits = copy.deepcopy(base)
    digits["pre_tokenizer"]["pretokenizers"].insert(0, {"type": "Digits", "individual_digits": True})
    variants["digits"] = digits
    return {name: save_json(config, os.path.join(directory, f"{name}.json")) for name, config in variants.items()}


def train_sentencepiece_style(directory, lines=None):
    """Llama 2 / Mistral layout: BPE with byte_fallback and <unk>, "<0x00>".."<0xFF>" in
    the vocab after <unk>, <s>, </s>; normalizer Prepend("▁") + Replace(" ", "▁"), no
    pre-tokenizer; decoder Replace + ByteFallback + Fuse + Strip. Variants use the
    Metaspace pre-tokenizer instead. Trained on `lines` (default corpus())."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=150,
                                  show_progress=False)
    tok.train_from_iterator(lines or corpus(), trainer)
    config = json.loads(tok.to_str())
    vocab = config["model"]["vocab"]
    shifted = {}
    for token, i in vocab.items():
        shifted[token] = i if i < 3 else i + 256
    for b in range(256):
        shifted[f"<0x{b:02X}>"] = 3 + b
    config["model"]["vocab"] = shifted
    for added in config["added_tokens"]:
        added["id"] = shifted[added["content"]]
    config["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    }
    llama2 = copy.deepcopy(config)
    llama2["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    llama2["pre_tokenizer"] = None
    llama2["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    metaspace_decoder = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True},
        {"type": "Fuse"}]}
    first = copy.deepcopy(config)
    first["decoder"] = metaspace_decoder
    always = copy.deepcopy(config)
    always["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": False}
    always["decoder"] = metaspace_decoder
    added = copy.deepcopy(llama2)
    next_id = max(shifted.values()) + 1
    added["added_tokens"].append({"id": next_id, "content": "forge", "single_word": False, "lstrip": False,
                                  "rstrip": False, "normalized": True, "special": False})
    variants = {"llama2-style": llama2, "metaspace-first": first, "metaspace-always-nosplit": always,
                "llama2-normalized-added": added}
    return {name: save_json(c, os.path.join(directory, f"{name}.json")) for name, c in variants.items()}


def train_sentencepiece_model(directory):
    """A tokenizer.model trained by the sentencepiece package: model_type bpe, byte_fallback."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_writer=model, vocab_size=800, model_type="bpe", byte_fallback=True,
        character_coverage=0.98, minloglevel=2)
    path = os.path.join(directory, "tokenizer.model")
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return path


def train_tiktoken_file(directory):
    """A tiktoken BPE file as Meta ships Llama 3's tokenizer.model: a byte-level BPE trained
    by tokenizers on the Llama 3 split (no special tokens), each token's bytes with its id
    as rank, one '<base64> <rank>' line per token in rank order, as
    tiktoken.load.dump_tiktoken_bpe writes (which needs blobfile, so it is done here)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    byte_of_character = {character: byte for byte, character in bytes_to_unicode().items()}
    ranks = {bytes(byte_of_character[c] for c in token): rank for token, rank in tok.get_vocab().items()}
    path = os.path.join(directory, "tokenizer.model")
    with open(path, "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
    return path
