#!/usr/bin/env python3
"""How much a weight-gradient GEMM gains from running beside the backward's other work.

Times, on one GPU with PyTorch, each pair alone and then both at once on two streams:
  - an 8B-shape weight-gradient GEMM (gate/up: [28672, 4096] from 8192 tokens) beside cuDNN attention backward
    (seq 8192, 32 query / 8 KV heads, head dim 128, causal),
  - the same GEMM beside memory-bound elementwise work of the backward's size (a SwiGLU
    backward-like pass over [8192, 28672] bf16).
If "together" is well below "alone A + alone B", moving forge's weight-gradient GEMMs
to a stream of their own can hide part of the rest of the backward. Prints one line per
pair, then the attention backward's time alone against its time right after GEMMs (as it
runs inside a training step). Usage: python3 scripts/overlap-probe.py
"""
import torch
import torch.nn.functional as F


def timed(fn, repeats=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def main():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    t, h, f = 8192, 4096, 14336
    # o-projection and gate/up weight gradients: dW[out, in] += dY^T X
    d_y = torch.randn(t, 2 * f, device=dev, dtype=torch.bfloat16)
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    d_w = torch.zeros(2 * f, h, device=dev, dtype=torch.bfloat16)  # forge's is fp32; same tensor-core work

    def gemm():
        torch.mm(d_y.t(), x, out=d_w)

    q = torch.randn(1, 32, t, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, t, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 8, t, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    d_o = torch.randn_like(o)

    def attention_backward():
        torch.autograd.grad(o, (q, k, v), d_o, retain_graph=True)

    gate_up = torch.randn(t, 2 * f, device=dev, dtype=torch.bfloat16)
    d_s = torch.randn(t, f, device=dev, dtype=torch.bfloat16)
    d_gu = torch.empty_like(gate_up)

    def elementwise():
        g, u = gate_up[:, :f], gate_up[:, f:]
        sg = torch.sigmoid(g)
        torch.mul(d_s * u, sg * (1 + g * (1 - sg)), out=d_gu[:, :f])
        torch.mul(d_s * g, sg, out=d_gu[:, f:])

    side = torch.cuda.Stream()

    def together(other):
        def run():
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                gemm()
            other()
            main.wait_stream(side)
        return run

    g_ms = timed(gemm)
    for name, other in (("attention backward", attention_backward), ("swiglu-backward-like", elementwise)):
        o_ms = timed(other)
        both = timed(together(other))
        print(f"overlap-probe: gemm {g_ms:.3f} ms + {name} {o_ms:.3f} ms = {g_ms + o_ms:.3f} ms alone; "
              f"{both:.3f} ms on two streams ({(g_ms + o_ms - both) / (g_ms + o_ms) * 100:.1f}% saved)")

    # Attention between GEMMs, as in a training step: is it slower than alone (clocks drawn
    # down by the GEMMs' power, cold caches)? Both timed by events around the attention only.
    def between_gemms(repeats=20):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(repeats + 3):
            for _ in range(4):
                gemm()
            start.record()
            attention_backward()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        times = sorted(times[3:])
        return times[len(times) // 2]

    alone = timed(attention_backward)
    after = between_gemms()
    print(f"overlap-probe: attention backward alone {alone:.3f} ms, right after 4 GEMMs {after:.3f} ms "
          f"({(after - alone) / alone * 100:+.1f}%); cuDNN {torch.backends.cudnn.version()}")


if __name__ == "__main__":
    main()
