"""forge's FP8 CPU reference (src/kernels/cpu/fp8.h, fp8_scaling.h) against PyTorch and
torchao's formulas. Casts: every one of the 65,536 bf16 bit patterns and 4 million random
fp32 values (normal at many magnitudes, uniform bit patterns, subnormals of fp32 and of
both FP8 formats, the rounding boundaries around each format's largest finite value, ties,
+-0, +-inf, NaN) cast to float8_e4m3fn and float8_e5m2, plain (torch's .to, bit for bit)
and saturating (torchao's to_fp8_saturated: clamp to +-max, then .to), and all 256 codes of
each format decoded. Scales: amax, scale and codes per block for torchao's tensorwise
(amax_to_scale) and rowwise (round_scales_to_power_of_2) recipes and Transformer Engine's
1x128 / 128x128 block scaling (power-of-2 scales, epsilon 0), computed here with torch ops
as those libraries write them (torchao 0.18 float8/float8_utils.py; TE
common/recipe/recipe_common.cuh), or with torchao's own functions when torchao imports."""
import os
import subprocess
import sys

import numpy as np
import torch

from forge_test_util import scratch_dir, tool

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def cast_inputs():
    g = torch.Generator().manual_seed(15)
    parts = [torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()]
    for scale in (1e-6, 1e-3, 0.02, 1.0, 30.0, 400.0, 3e4, 1e6):
        parts.append(torch.randn(250_000, generator=g) * scale)
    bits = torch.randint(-2**31, 2**31 - 1, (1_000_000,), generator=g, dtype=torch.int64).to(torch.int32)
    parts.append(bits.view(torch.float32))  # every exponent, fp32 subnormals, NaN payloads
    parts.append(torch.rand(500_000, generator=g) * 2.0**-6)  # FP8 subnormals and the smallest normals
    parts.append(torch.rand(500_000, generator=g) * 2.0**-13)
    specials = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan")]
    for top in (448.0, 57344.0):
        for v in (top, top * (1 + 2.0**-4), top * (1 + 2.0**-3), top * (1 + 2.0**-2), 464.0, 480.0, 61440.0):
            f = torch.tensor(v, dtype=torch.float32)
            specials += [float(torch.nextafter(f, torch.tensor(0.0))), v, float(torch.nextafter(f, torch.tensor(1e30)))]
    for e in range(-20, 17):  # ties between neighbouring codes at every binade
        for m in range(16):
            specials.append((1 + (2 * m + 1) / 32) * 2.0**e)
    parts.append(torch.tensor(specials, dtype=torch.float32))
    x = torch.cat(parts)
    return torch.cat([x, -x])


def codes(t, dtype):
    return t.to(dtype).view(torch.uint8).numpy()


def saturated(x, dtype):
    try:
        from torchao.float8.float8_utils import to_fp8_saturated
        return to_fp8_saturated(x, dtype).view(torch.uint8).numpy()
    except ImportError:
        top = torch.finfo(dtype).max
        return x.clamp(min=-top, max=top).to(dtype).view(torch.uint8).numpy()


def run(args):
    result = subprocess.run([tool("forge_fp8")] + args, capture_output=True, text=True)
    if result.returncode != 0:
        raise AssertionError(f"forge_fp8 {args[0]} exited {result.returncode}: {result.stderr}")


def check_casts(directory):
    x = cast_inputs()
    path = os.path.join(directory, "values.f32")
    x.numpy().tofile(path)
    run(["cast", path, directory])
    failures = []
    for name, dtype in FORMATS.items():
        for suffix, expected in (("", codes(x, dtype)), ("_saturated", saturated(x, dtype))):
            got = np.fromfile(os.path.join(directory, name + suffix), dtype=np.uint8)
            bad = np.nonzero(got != expected)[0]
            print(f"cast to {name}{suffix or ' (plain)':12} {x.numel():9} values: "
                  f"{'bitwise equal' if bad.size == 0 else f'{bad.size} DIFFER'}")
            for i in bad[:5]:
                print(f"   {float(x[i])!r} ({hex(x[i:i+1].view(torch.int32).item() & 0xffffffff)}): "
                      f"forge {hex(got[i])}, torch {hex(expected[i])}")
            if bad.size:
                failures.append(name + suffix)
        decoded = np.fromfile(os.path.join(directory, "decoded_" + name), dtype=np.float32)
        expected = torch.arange(256, dtype=torch.uint8).view(dtype).float().numpy()
        same = np.array_equal(np.isnan(decoded), np.isnan(expected)) and np.array_equal(
            decoded[~np.isnan(decoded)].view(np.int32), expected[~np.isnan(expected)].view(np.int32))
        print(f"decode {name}: 256 codes {'bitwise equal' if same else 'DIFFER'}")
        if not same:
            failures.append("decode " + name)
    return failures


def torchao_scale(amax, dtype, power_of_2):
    try:
        from torchao.float8.float8_utils import amax_to_scale
        return amax_to_scale(amax, dtype, round_scales_to_power_of_2=power_of_2)
    except ImportError:
        res = (torch.finfo(dtype).max / torch.clamp(amax.to(torch.float64), min=1e-12)).to(torch.float32)
        return torch.exp2(torch.floor(torch.log2(res))) if power_of_2 else res


def te_pow2_scale(amax, dtype):
    amax = amax.clone()
    scale = (torch.tensor(torch.finfo(dtype).max, dtype=torch.float32) / amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, torch.finfo(torch.float32).max), scale)
    scale = (scale.view(torch.int32) & -8388608).view(torch.float32)  # clear the mantissa: 0xff800000
    return torch.where((amax == 0) | ~torch.isfinite(amax), torch.ones_like(scale), scale)


def block_amax(x, block_rows, block_cols):
    rows, cols = x.shape
    pad_r, pad_c = -rows % block_rows, -cols % block_cols
    padded = torch.nn.functional.pad(x.abs(), (0, pad_c, 0, pad_r))
    tiles = padded.reshape((rows + pad_r) // block_rows, block_rows, (cols + pad_c) // block_cols, block_cols)
    return tiles.amax(dim=(1, 3))


def expand(per_block, block_rows, block_cols, shape):
    full = per_block.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
    return full[:shape[0], :shape[1]]


def check_scaling(directory):
    g = torch.Generator().manual_seed(16)
    x = torch.randn(300, 520, generator=g) * torch.logspace(-8, 3, 300).unsqueeze(1)
    x[7] = 0.0  # a zero row: the scale of amax 0
    x[11, 100:228] = 0.0
    x[20, 5] = 1e38  # an amax whose scale is tiny
    x[30] = 1e-30  # amax below torchao's epsilon
    cases = [("tensorwise e4m3", 300, 520, "e4m3", "torchao"), ("tensorwise e5m2", 300, 520, "e5m2", "torchao"),
             ("rowwise e4m3", 1, 520, "e4m3", "torchao_pow2"), ("rowwise e5m2", 1, 520, "e5m2", "torchao_pow2"),
             ("TE 1x128 e4m3", 1, 128, "e4m3", "te_pow2"), ("TE 128x128 e4m3", 128, 128, "e4m3", "te_pow2"),
             ("TE 1x128 e5m2", 1, 128, "e5m2", "te_pow2")]
    path = os.path.join(directory, "tensor.f32")
    x.numpy().tofile(path)
    failures = []
    for name, block_rows, block_cols, fmt, rule in cases:
        dtype = FORMATS[fmt]
        run(["quantize", path, "300", "520", str(block_rows), str(block_cols), fmt, rule, directory])
        amax = block_amax(x, block_rows, block_cols)
        scale = te_pow2_scale(amax, dtype) if rule == "te_pow2" else torchao_scale(amax, dtype, rule == "torchao_pow2")
        q = saturated(x * expand(scale, block_rows, block_cols, x.shape), dtype).reshape(-1)
        got = {key: np.fromfile(os.path.join(directory, key), dtype=np.uint8 if key == "codes" else np.int32)
               for key in ("amax", "scales", "codes")}
        want = {"amax": amax.reshape(-1).view(torch.int32).numpy(), "scales": scale.reshape(-1).view(torch.int32).numpy(),
                "codes": q}
        differing = [key for key in want if not np.array_equal(got[key], want[key])]
        print(f"{name:16} {amax.numel():6} scales: {'bitwise equal' if not differing else 'DIFFER: ' + ', '.join(differing)}")
        if differing:
            failures.append(name)
    return failures


def check_rejected(directory):
    path = os.path.join(directory, "three.f32")
    np.zeros(3, dtype=np.float32).tofile(path)
    result = subprocess.run([tool("forge_fp8"), "quantize", path, "2", "2", "1", "1", "e4m3", "torchao", directory],
                            capture_output=True, text=True)
    ok = result.returncode == 1 and "holds 3 values, not 2 x 2" in result.stderr
    result = subprocess.run([tool("forge_fp8"), "quantize", path, "1", "3", "1", "1", "e3m4", "torchao", directory],
                            capture_output=True, text=True)
    ok = ok and result.returncode == 1 and "expected e4m3 or e5m2" in result.stderr
    print(f"bad inputs rejected: {'ok' if ok else 'NO'}")
    return [] if ok else ["bad inputs"]


def main():
    try:
        import torchao.float8.float8_utils  # noqa: F401
        print("scales and saturation from torchao's own functions")
    except ImportError:
        print("torchao not installed: its formulas written out with torch ops (torchao 0.18 float8_utils.py)")
    directory = scratch_dir()
    failures = check_casts(directory) + check_scaling(directory) + check_rejected(directory)
    if failures:
        print("forge's FP8 reference differs for:", ", ".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
