"""CLIP tokenizer folders for the tests, made offline: vocab.json and merges.txt laid out as
OpenAI's CLIP vocabulary is (the 256 byte characters, each again with "</w>", the merged
tokens in merge order, then <|startoftext|> and <|endoftext|>), with merges trained by
Hugging Face tokenizers on CLIP's own normalizer and pre-tokenizer; and the
tokenizer_config.json / special_tokens_map.json variants published CLIP tokenizers use."""
import io
import json
import os

START, END = "<|startoftext|>", "<|endoftext|>"
SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


def byte_characters():
    """GPT-2's bytes-to-characters map, in byte order of its table (printable bytes first)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    characters, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            characters.append(256 + extra)
            extra += 1
    return [chr(c) for c in characters]


def train_merges(texts, vocab_size):
    """BPE merges over CLIP's normalized, pre-tokenized words, with the "</w>" suffix."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(SPLIT), behavior="removed", invert=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, end_of_word_suffix="</w>", show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [m.split(" ") if isinstance(m, str) else m for m in merges]


def write_vocab_and_merges(directory, merges):
    os.makedirs(directory, exist_ok=True)
    characters = byte_characters()
    tokens = characters + [c + "</w>" for c in characters]
    known = set(tokens)
    kept = []
    for left, right in merges:
        if left in known and right in known and left + right not in known:
            tokens.append(left + right)
            known.add(left + right)
            kept.append((left, right))
    tokens += [START, END]
    with open(os.path.join(directory, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({token: i for i, token in enumerate(tokens)}, f, ensure_ascii=False)
    with open(os.path.join(directory, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for left, right in kept:
            f.write(f"{left} {right}\n")
    return {token: i for i, token in enumerate(tokens)}


def flux_tokenizer_config(vocab):
    """tokenizer_config.json as FLUX.1's tokenizer/ (saved by transformers 4.4x) has it."""
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(vocab[START]): {"content": START, "lstrip": False, "normalized": True, "rstrip": False,
                                "single_word": False, "special": True},
            str(vocab[END]): {"content": END, "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False, "special": True}},
        "bos_token": START, "clean_up_tokenization_spaces": True, "do_lower_case": True, "eos_token": END,
        "errors": "replace", "model_max_length": 77, "pad_token": END, "tokenizer_class": "CLIPTokenizer",
        "unk_token": END}


def flux_special_tokens_map():
    def token(content, normalized):
        return {"content": content, "lstrip": False, "normalized": normalized, "rstrip": False, "single_word": False}
    return {"bos_token": token(START, True), "eos_token": token(END, False), "pad_token": END,
            "unk_token": token(END, False)}


def legacy_tokenizer_config():
    """The older layout (openai/clip-vit-base-patch32's): AddedToken objects, no decoder."""
    def token(content):
        return {"content": content, "single_word": False, "lstrip": False, "rstrip": False, "normalized": True,
                "__type": "AddedToken"}
    return {"unk_token": token(END), "bos_token": token(START), "eos_token": token(END), "pad_token": END,
            "add_prefix_space": False, "errors": "replace", "do_lower_case": True, "model_max_length": 77,
            "special_tokens_map_file": "./special_tokens_map.json", "tokenizer_class": "CLIPTokenizer"}


def write_json(path, value):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False)
