"""forge's NF4 quantizer stores bitwise what bitsandbytes' CPU backend stores for
quantize_4bit(w, quant_type="nf4", blocksize=64, compress_statistics=True): the packed
codes, the absmax codes, the second-level scales, the offset and both code tables; and its
dequantization to fp32 and to bf16 equals dequantize_4bit's bit for bit (NOTE [NF4 storage]
in src/ops/nf4.h). Weights: random normal in several shapes (odd sizes, partial blocks of
64 and of 256, cascade-summed absmax counts), fp32 and bf16, with outliers, zero blocks,
all-zero and constant weights, and tiny values. Then a small Hugging Face Llama saved in
bf16: the base forge quantizes at import (the seven projections of every block, one NF4
tensor per Hugging Face weight, NOTE [NF4 base weights]) is what bitsandbytes stores for
each of those tensors, and nothing else is quantized."""
import os
import subprocess
import sys
import warnings

import numpy as np
import torch

warnings.filterwarnings("ignore")
import logging  # noqa: E402

logging.disable(logging.WARNING)  # bitsandbytes warns that an optional CPU kernel package is absent
import bitsandbytes.functional as F  # noqa: E402

from forge_test_util import scratch_dir, tool  # noqa: E402


def weights():
    g = torch.Generator().manual_seed(16)
    cases = []
    for rows, cols in [(3, 100), (64, 64), (1, 1), (7, 9), (5, 13), (1, 65), (33, 127), (128, 300), (256, 1280),
                       (512, 700)]:
        cases.append((f"normal {rows}x{cols}", torch.randn(rows, cols, generator=g) * 0.02))
    w = torch.randn(96, 200, generator=g) * 0.02
    w.view(-1)[torch.randint(0, w.numel(), (40,), generator=g)] *= 1000.0
    cases.append(("outliers 96x200", w))
    w = torch.randn(40, 128, generator=g)
    w[3:9] = 0.0
    w.view(-1)[5000:5100] = 0.0
    cases.append(("zero blocks 40x128", w))
    cases.append(("all zero 20x1000", torch.zeros(20, 1000)))
    cases.append(("constant 30x512", torch.full((30, 512), -0.375)))
    cases.append(("tiny 17x96", torch.randn(17, 96, generator=g) * 1e-30))
    w = torch.randn(64, 64, generator=g)
    w.view(-1)[::7] = F.get_4bit_type("nf4", device="cpu")[torch.arange(0, 586) % 16]  # exact levels and ties
    cases.append(("on the levels 64x64", w))
    out = []
    for name, w in cases:
        out.append((name + " f32", w.float()))
        out.append((name + " bf16", w.bfloat16()))
    return out


def bits(t):
    t = t.contiguous()
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).numpy() if t.is_floating_point() else t.numpy()


def forge_quantize(w, directory):
    raw = os.path.join(directory, "weights.raw")
    w.contiguous().view(torch.int16 if w.dtype == torch.bfloat16 else torch.int32).numpy().tofile(raw)
    dtype = "bf16" if w.dtype == torch.bfloat16 else "f32"
    result = subprocess.run([tool("forge_nf4"), raw, dtype, str(w.shape[0]), str(w.shape[1]), directory], capture_output=True, text=True)
    if result.returncode != 0:
        raise AssertionError(f"forge_nf4 exited {result.returncode}: {result.stderr}")

    def load(name, dtype):
        return np.fromfile(os.path.join(directory, name), dtype=dtype)

    return {name: load(name, dtype) for name, dtype in [
        ("codes", np.uint8), ("absmax_codes", np.uint8), ("absmax_scales", np.int32), ("offset", np.int32),
        ("absmax", np.int32), ("dequant_f32", np.int32), ("dequant_bf16", np.int16), ("nf4_code", np.int32),
        ("dynamic_code", np.int32)]}


def reference(w):
    packed, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
    # Dequantized as one row: bitsandbytes' AVX-512 kernel takes a row's blocks to start at
    # the row when in_features is a multiple of 16 but not of 64 (its scalar, NEON, Python
    # and CUDA kernels use the flattened weight's blocks, which is what was quantized).
    state.shape = torch.Size([w.numel()])
    dequant = {}
    for dtype in (torch.float32, torch.bfloat16):
        state.dtype = dtype
        dequant[dtype] = F.dequantize_4bit(packed, state)
    return {
        "codes": packed.view(-1).numpy(), "absmax_codes": state.absmax.numpy(),
        "absmax_scales": bits(state.state2.absmax), "offset": bits(state.offset.reshape(1)), "absmax": bits(absmax),
        "dequant_f32": bits(dequant[torch.float32]).reshape(-1),
        "dequant_bf16": bits(dequant[torch.bfloat16]).reshape(-1), "nf4_code": bits(state.code),
        "dynamic_code": bits(state.state2.code),
    }


def check_rejected(directory, w, dtype, rows, cols, expected):
    raw = os.path.join(directory, "bad.raw")
    w.tofile(raw)
    result = subprocess.run([tool("forge_nf4"), raw, dtype, str(rows), str(cols), directory],
                            capture_output=True, text=True)
    ok = result.returncode == 1 and expected in result.stderr
    print(f"rejects {expected!r}: {'ok' if ok else 'NO: ' + result.stderr.strip()}")
    return ok


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_model_import(directory):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(16)
    config = LlamaConfig(vocab_size=50, hidden_size=128, intermediate_size=200, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    source = os.path.join(directory, "model")
    model.save_pretrained(source)
    out = os.path.join(directory, "base")
    os.makedirs(out)
    result = subprocess.run([tool("forge_nf4"), "--hf", source, out], capture_output=True, text=True)
    if result.returncode != 0:
        raise AssertionError(f"forge_nf4 --hf exited {result.returncode}: {result.stderr}")
    with open(os.path.join(out, "quantized")) as f:
        quantized = sorted(f.read().split())
    state = model.state_dict()
    expected = sorted(name for name in state if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS)
    failures = [] if quantized == expected else [f"quantized {quantized}, expected {expected}"]
    for name in expected:
        packed, qstate = F.quantize_4bit(state[name], blocksize=64, compress_statistics=True, quant_type="nf4")
        theirs = {"codes": packed.view(-1).numpy(), "absmax_codes": qstate.absmax.numpy(),
                  "absmax_scales": bits(qstate.state2.absmax), "offset": bits(qstate.offset.reshape(1))}
        for field, want in theirs.items():
            path = os.path.join(out, f"{name}.{field}")
            got = np.fromfile(path, dtype=want.dtype) if os.path.exists(path) else None
            if got is None or not np.array_equal(got, want):
                failures.append(f"{name}.{field}")
    print(f"Hugging Face import: {len(expected)} projection tensors, "
          f"{'bitwise equal' if not failures else 'DIFFER: ' + ', '.join(failures)}")
    return failures


def main():
    torch.set_num_threads(1)  # one summation order for the offset (NOTE [NF4 storage])
    directory = scratch_dir()
    failures = check_model_import(directory)
    for name, w in weights():
        ours, theirs = forge_quantize(w, directory), reference(w)
        differing = []
        for key, expected in theirs.items():
            actual = ours[key]
            if actual.shape != expected.shape or not np.array_equal(actual, expected):
                count = int((actual != expected).sum()) if actual.shape == expected.shape else "shape"
                differing.append(f"{key} ({count})")
        blocks = -(-w.numel() // 64)
        print(f"{name:30} {blocks:6} blocks: {'bitwise equal' if not differing else 'DIFFER: ' + ', '.join(differing)}")
        if differing:
            failures.append(name)
    bad = np.array([1.0, float("nan"), 2.0, 3.0], dtype=np.float32)
    if not check_rejected(directory, bad, "f32", 2, 2, "element 1 of the weight [2, 2] is nan"):
        failures.append("NaN weight")
    if not check_rejected(directory, np.zeros(0, dtype=np.float32), "f32", 0, 5, "has no elements"):
        failures.append("empty weight")
    if failures:
        print("forge's NF4 differs from bitsandbytes for:", ", ".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
