#!/usr/bin/env python3
"""Writes the seed corpora of fuzz/corpus/<harness>/ (run with .venv's Python, which has
tokenizers, sentencepiece, safetensors, transformers and zstandard; `forge` for the
checkpoint seeds: python fuzz/make_corpus.py [path/to/forge]). Every seed is made here
from made-up text and tiny made-up models, so the corpora carry no third-party data."""
import base64, gzip, io, json, os, pickle, struct, subprocess, sys, tempfile
import numpy as np

ROOT = os.path.dirname(os.path.abspath(__file__))
TEXT = ("The quick brown fox jumps over the lazy dog. 12345 67890\n"
        "Grüße aus Köln, naïve café. Слава труду. 日本語のテキスト。 🙂👍\n"
        "  indented\tline with tabs\r\nand CRLF; don't won't I'm you're\n") * 3


def put(harness, name, data):
    d = os.path.join(ROOT, "corpus", harness)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def json_lines():
    for i, line in enumerate([
            '{"text": "hello world"}', '{"id": 3, "text": "caf\\u00e9 \\ud83d\\ude42 \\n tab\\t"}',
            '{"meta": {"a": [1, 2.5e10, NaN, Infinity, -Infinity, null, true]}, "text": ""}',
            '\ufeff{"text": "bom", "text": "duplicate key"}', '{"text": 12}', '{"text": "\\ud800 lone"}',
            '[1, 2, {"text": "x"}]', '{"content": "other key", "n": 1e400}']):
        put("fuzz_json_line", f"line{i}", line)


def experiments():
    for name in ["debug-tiny.yaml", "h100/llama3.2-1b-seq4096.yaml", "h200/llama3.1-8b-fsdp8-seq8192.yaml"]:
        with open(os.path.join(ROOT, "..", "configs", "experiments", name)) as f:
            put("fuzz_experiment_yaml", os.path.basename(name), f.read())
    put("fuzz_experiment_yaml", "inline-model.yaml",
        "model:\n  name: llama3.2-1b\n  num_layers: 2\n  hidden_size: 128\ntraining:\n  seq_len: 64\n"
        "  local_batch_size: 2\ndata:\n  source: mock\n")
    put("fuzz_experiment_yaml", "with-overrides",
        "model:\n  name: debug-tiny\n\0--training.seq_len=64\n--optimizer.lr\n1e-3\n--model.name\nmistral-7b-v0.1\n"
        "--data.blend=0.3,a,0.7,b\n--checkpoint.enable\ntrue")
    put("fuzz_experiment_yaml", "empty-with-overrides", "\0--training.steps=5\n--model.hidden_size=128")


def indexed():
    def dataset(dtype_code, np_dtype, docs):
        seqs = [s for doc in docs for s in doc]
        lengths = [len(s) for s in seqs]
        size = np.dtype(np_dtype).itemsize
        pointers, p = [], 0
        for n in lengths:
            pointers.append(p)
            p += n * size
        doc_idx, k = [0], 0
        for doc in docs:
            k += len(doc)
            doc_idx.append(k)
        idx = b"MMIDIDX\0\0" + struct.pack("<QBQQ", 1, dtype_code, len(seqs), len(doc_idx))
        idx += np.array(lengths, "<i4").tobytes() + np.array(pointers, "<i8").tobytes() + np.array(doc_idx, "<i8").tobytes()
        bin_ = b"".join(np.array(s, np_dtype).tobytes() for s in seqs)
        return struct.pack("<I", len(idx)) + idx + bin_
    put("fuzz_indexed_dataset", "uint16", dataset(8, "<u2", [[[1, 2, 3], [4, 5]], [[6]], [[7, 8, 9, 10]]]))
    put("fuzz_indexed_dataset", "int32", dataset(4, "<i4", [[[100000, 2]], [[3, 4, 5]]]))
    put("fuzz_indexed_dataset", "int64-empty-seq", dataset(5, "<i8", [[[1], []], [[2, 3]]]))
    put("fuzz_indexed_dataset", "uint8", dataset(1, "<u1", [[[1, 2, 255]]]))


def safetensors_files():
    from safetensors.numpy import save
    put("fuzz_safetensors", "f32", save({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(2, np.float32)},
                                        metadata={"format": "pt"}))
    put("fuzz_safetensors", "f16-f64-i64", save({"h": np.full((2, 2), 1.5, np.float16), "d": np.arange(3, dtype=np.float64),
                                                 "i": np.arange(2, dtype=np.int64), "s": np.zeros((), np.float32)}))
    header = json.dumps({"w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]},
                         "e": {"dtype": "F32", "shape": [0, 4], "data_offsets": [8, 8]}}).encode()
    put("fuzz_safetensors", "bf16-empty", struct.pack("<Q", len(header)) + header + bytes([0x80, 0x3f] * 4))


def hf_configs():
    from transformers import LlamaConfig, MistralConfig, MixtralConfig
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    put("fuzz_hf_config", "llama", LlamaConfig(**small).to_json_string())
    put("fuzz_hf_config", "llama3-rope", LlamaConfig(**small, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, tie_word_embeddings=True, head_dim=16).to_json_string())
    put("fuzz_hf_config", "mistral", MistralConfig(**small, sliding_window=64).to_json_string())
    put("fuzz_hf_config", "mixtral", MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2,
                                                   output_router_logits=True, router_aux_loss_coef=0.02).to_json_string())
    put("fuzz_hf_config", "old-names", json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "max_position_embeddings": 64}))


def hf_weight_index():
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    put("fuzz_hf_weight_index", "valid", json.dumps({"metadata": {"total_size": 80}, "weight_map": {
        "model.embed_tokens.weight": first, "model.norm.weight": first, "lm_head.weight": second}}, indent=2))
    put("fuzz_hf_weight_index", "missing-tensor", json.dumps({"weight_map": {"model.embed_tokens.weight": first,
                                                                             "lm_head.weight": second}}))
    put("fuzz_hf_weight_index", "climbing-name", json.dumps({"weight_map": {"lm_head.weight": "../x.safetensors"}}))


def tokenizers_json():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers, Regex
    llama3_pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                      r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(llama3_pattern), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    put("fuzz_tokenizer_json", "byte-level", tok.to_str())
    put("fuzz_tokenizer_json", "byte-level-with-text", tok.to_str() + "\0<|begin_of_text|>Hello  there 123456!\n")
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=120, show_progress=False,
        special_tokens=["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]))
    put("fuzz_tokenizer_json", "sentencepiece-style", tok.to_str())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(), pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.Whitespace()])
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=80, show_progress=False))
    put("fuzz_tokenizer_json", "metaspace-digits", tok.to_str())


def sentencepiece_models():
    import sentencepiece as spm
    with tempfile.TemporaryDirectory() as d:
        text = os.path.join(d, "text.txt")
        with open(text, "w") as f:
            f.write(TEXT * 4)
        for model_type, extra in [("bpe", dict(byte_fallback=True)), ("unigram", dict(user_defined_symbols=["<tag>"]))]:
            prefix = os.path.join(d, model_type)
            spm.SentencePieceTrainer.train(input=text, model_prefix=prefix, vocab_size=400 if model_type == "bpe" else 80,
                                           model_type=model_type, normalization_rule_name="identity",
                                           character_coverage=1.0, minloglevel=2, **extra)
            with open(prefix + ".model", "rb") as f:
                put("fuzz_sentencepiece_model", model_type, f.read())


def tiktoken_files():
    ranks = [bytes([b]) for b in range(256)] + [b"th", b"he", b"the", b" the", b"in", b"er", b"  ", b"\n\n"]
    body = "".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks))
    put("fuzz_tiktoken_bpe", "small", body)
    put("fuzz_tiktoken_bpe", "small-with-text", body + "\0the other theme\n\n  <|begin_of_text|>")


def corpus_files():
    jsonl = "".join(json.dumps({"text": line}) + "\n" for line in TEXT.splitlines()) + "not json\n"
    plain = TEXT
    import zstandard
    put("fuzz_document_reader", "jsonl", b"\x00" + jsonl.encode())
    put("fuzz_document_reader", "txt-per-line", b"\x09" + plain.encode())
    put("fuzz_document_reader", "jsonl-gz-skip", b"\x12" + gzip.compress(jsonl.encode()) + gzip.compress(b'{"text": "2nd member"}\n'))
    put("fuzz_document_reader", "jsonl-zst", b"\x03" + zstandard.ZstdCompressor().compress(jsonl.encode()))
    put("fuzz_document_reader", "txt-gz", b"\x04" + gzip.compress(plain.encode()))
    put("fuzz_document_reader", "txt-zst-two-frames", b"\x0d" + zstandard.ZstdCompressor().compress(b"a\nb\n") +
        zstandard.ZstdCompressor(write_content_size=False).compress(b"c\r\nd"))
    # Bits 6-7 of the first byte: a 1-byte and a 64-byte read buffer, lines across refills.
    put("fuzz_document_reader", "jsonl-buffer-1", b"\xc0" + jsonl.encode())
    put("fuzz_document_reader", "txt-gz-per-line-buffer-64", b"\x8c" + gzip.compress(plain.encode(), mtime=0))


def checkpoints(forge):
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "tiny.yaml"), "w") as f:
            f.write("model:\n  name: debug-tiny\n  vocab_size: 8\n  hidden_size: 4\n  num_layers: 1\n  num_heads: 1\n"
                    "  num_kv_heads: 1\n  ffn_hidden_size: 8\n  max_seq_len: 8\ntraining:\n  local_batch_size: 1\n"
                    "  seq_len: 8\n  steps: 1\n  device: cpu\ncheckpoint:\n  enable: true\n  interval: 1\n"
                    f"logging:\n  run_dir: {d}/run\n  enable_tensorboard: false\neval:\n  interval: 0\n")
        subprocess.run([forge, "train", os.path.join(d, "tiny.yaml")], check=True, capture_output=True,
                       env=dict(os.environ, FORGE_NUM_THREADS="1"))
        step = os.path.join(d, "run", "checkpoints", "step-1")
        with open(os.path.join(step, "metadata.json"), "rb") as f:
            metadata = f.read()
        with open(os.path.join(step, "rank-0.bin"), "rb") as f:
            shard = f.read()
        put("fuzz_checkpoint_metadata", "tiny-step-1", metadata + b"\0" + shard)
        put("fuzz_checkpoint_metadata", "tiny-step-1-no-shard", metadata)


def npy_files():
    def npy(array, version=None, protocol=None):
        f = io.BytesIO()
        if protocol is None:
            np.lib.format.write_array(f, array, version=version)
        else:  # an object array pickled as numpy 1 (protocol 3) or numpy 2 (4) saves it
            np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(array))
            f.write(pickle.dumps(array, protocol=protocol))
        return f.getvalue()
    put("fuzz_npy", "i4-2d-v1", npy(np.arange(12, dtype="<i4").reshape(3, 4)))
    put("fuzz_npy", "u2-be-v2", npy(np.arange(5, dtype=">u2"), (2, 0)))
    put("fuzz_npy", "i8-0d-v3", npy(np.array(-7, dtype="<i8"), (3, 0)))
    put("fuzz_npy", "bool-empty", npy(np.zeros((0, 3), dtype="?")))
    records = np.empty(2, dtype=object)
    records[0] = {"input_ids": np.arange(9, dtype=np.int64), "loss_mask": [0, 0, 1, 1, 1, 1, 1, 1, 0],
                  "seq_start_id": [0]}
    records[1] = {"input_ids": np.arange(9, dtype=np.int32), "loss_mask": [1] * 9, "seq_start_id": [0, 4]}
    put("fuzz_npy", "records-protocol3", npy(records, protocol=3))
    put("fuzz_npy", "records-protocol4", npy(records, protocol=4))


def t5_configs():
    from transformers import T5Config
    put("fuzz_t5_config", "t5-v1_1-small", T5Config(vocab_size=64, d_model=16, d_kv=4, num_heads=4, d_ff=32, num_layers=2,
                                                    feed_forward_proj="gated-gelu").to_json_string())
    put("fuzz_t5_config", "original-t5-relu", T5Config(vocab_size=64, d_model=16, d_kv=4, num_heads=4, d_ff=32,
                                                       num_layers=2).to_json_string())
    put("fuzz_t5_config", "bucket-edges", json.dumps({"feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 4,
                                                      "relative_attention_max_distance": 2, "dense_act_fn": "gelu_pytorch_tanh"}))


def t5_tokenizers():
    import sentencepiece as spm
    from transformers import T5TokenizerFast
    with tempfile.TemporaryDirectory() as d:
        text = os.path.join(d, "text.txt")
        with open(text, "w") as f:
            f.write(TEXT * 4)
        spm.SentencePieceTrainer.train(input=text, model_prefix=os.path.join(d, "spiece"), vocab_size=80,
                                       model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                       normalization_rule_name="identity",
                                       character_coverage=1.0, minloglevel=2)
        with open(os.path.join(d, "spiece.model"), "rb") as f:
            put("fuzz_t5_tokenizer", "spiece-model", f.read())
        T5TokenizerFast.from_pretrained(d, extra_ids=3).save_pretrained(os.path.join(d, "saved"))
        with open(os.path.join(d, "saved", "tokenizer.json")) as f:
            tokenizer_json = f.read()
        put("fuzz_t5_tokenizer", "tokenizer-json", tokenizer_json)
        put("fuzz_t5_tokenizer", "tokenizer-json-with-caption",
            tokenizer_json + "\0a  dog\u3000on </s> the <extra_id_2>ｆｕｌｌ\tgrass 🙂")


def tar_files():
    import tarfile
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (3, 2), (200, 10, 30)).save(png, format="PNG")
    for name, fmt in (("pax", tarfile.PAX_FORMAT), ("gnu", tarfile.GNU_FORMAT), ("ustar", tarfile.USTAR_FORMAT)):
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
            for key in ("0001", "d" * 60 + "/" + "k" * 50, "caf\u00e9" if fmt == tarfile.PAX_FORMAT else "0003"):
                for ext, data in (("json", b"{}"), ("png", png.getvalue()), ("txt", "a caption".encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        put("fuzz_tar_archive", name, out.getvalue())


if __name__ == "__main__":
    json_lines(); experiments(); indexed(); npy_files(); safetensors_files(); hf_configs(); hf_weight_index()
    tokenizers_json(); sentencepiece_models(); tiktoken_files(); corpus_files(); t5_configs(); t5_tokenizers(); tar_files()
    checkpoints(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "..", "build", "forge"))
