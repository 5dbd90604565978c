#!/usr/bin/env python3
"""Peer benchmark for FLUX (issue 22): diffusers' FluxTransformer2DModel trained with
rectified flow the way forge trains it, on the same shapes.

fp32 master weights with bf16 autocast, fused AdamW (lr 1e-5, betas 0.9/0.999, weight decay
0.01), global-norm clipping at 1, the flow-matching MSE on synthetic latents, text features
and pooled vectors (as forge's synthetic micro-batches), torch.compile of the transformer
with --compile, diffusers' gradient checkpointing with --checkpointing. Attention is
PyTorch's SDPA with its flash and memory-efficient backends: its cuDNN backend failed on
the H200 with PyTorch 2.11 (cuDNN 9.19) on these shapes ("mha_graph.execute(...) is_good()"
and illegal addresses in the backward, 2026-12-02), so it is switched off (--sdpa-cudnn
turns it back on). Prints one JSON line with images_per_s and model_tflops.

  python3 flux_train_bench.py --double 2 --single 4 --resolution 1024 --text 512 --batch 1 --compile

FLOPs per image: NOTE [FLUX FLOPs] in forge's src/model/flux_config.cpp, written out below.
"""
import argparse, json, time
import torch, torch.nn.functional as F
from diffusers import FluxTransformer2DModel


def flops_per_image(d, m, double, single, s, l, in_ch=64, ctx=4096, pooled=768, tdim=256, out_ch=64, guidance=True):
    t = s + l
    macs = (double + single) * ((4 * d * d + 2 * d * m) * t + 2 * t * t * d)
    macs += double * 12 * d * d + single * 3 * d * d
    macs += s * in_ch * d + l * ctx * d
    macs += (2 if guidance else 1) * (tdim * d + d * d) + pooled * d + d * d + 2 * d * d + s * d * out_ch
    return 6 * macs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--double", type=int, default=19)
    ap.add_argument("--single", type=int, default=38)
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--text", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="torch.compile of the whole transformer")
    ap.add_argument("--compile-blocks", action="store_true",
                    help="diffusers' regional compilation: torch.compile of each repeated block")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--sdpa-cudnn", action="store_true", help="allow SDPA's cuDNN backend")
    a = ap.parse_args()
    torch.backends.cuda.enable_cudnn_sdp(a.sdpa_cudnn)
    torch.manual_seed(0)
    model = FluxTransformer2DModel(num_layers=a.double, num_single_layers=a.single, guidance_embeds=True).cuda()
    if a.checkpointing:
        model.enable_gradient_checkpointing()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.999), weight_decay=0.01, fused=True)
    if a.compile_blocks:
        model.compile_repeated_blocks(fullgraph=True)
    f = torch.compile(model) if a.compile else model
    grid = a.resolution // 16
    s, l, B = grid * grid, a.text, a.batch
    img_ids = torch.zeros(grid, grid, 3, device="cuda")
    img_ids[..., 1] += torch.arange(grid, device="cuda")[:, None]
    img_ids[..., 2] += torch.arange(grid, device="cuda")[None, :]
    img_ids = img_ids.reshape(s, 3)
    txt_ids = torch.zeros(l, 3, device="cuda")
    guidance = torch.full((B,), 3.5, device="cuda")

    def step():
        for _ in range(a.accum):
            x0 = torch.randn(B, s, 64, device="cuda", dtype=torch.bfloat16)
            noise = torch.randn_like(x0)
            text = torch.randn(B, l, 4096, device="cuda", dtype=torch.bfloat16)
            pooled = torch.randn(B, 768, device="cuda", dtype=torch.bfloat16)
            t = torch.sigmoid(torch.randn(B, device="cuda"))
            xt = (1 - t[:, None, None]) * x0 + t[:, None, None] * noise
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = f(hidden_states=xt, encoder_hidden_states=text, pooled_projections=pooled, timestep=t,
                         img_ids=img_ids, txt_ids=txt_ids, guidance=guidance, return_dict=False)[0]
            loss = F.mse_loss(pred.float(), (noise - x0).float()) / a.accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / a.steps
    images = a.accum * B / dt
    flops = flops_per_image(3072, 12288, a.double, a.single, s, l)
    print(json.dumps(dict(peer="diffusers-flux", double=a.double, single=a.single, resolution=a.resolution, text=l,
                          batch=B, accum=a.accum, compile=a.compile, compile_blocks=a.compile_blocks, checkpointing=a.checkpointing,
                          step_ms=round(dt * 1e3, 1), images_per_s=round(images, 3),
                          model_tflops=round(images * flops / 1e12, 1),
                          peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1),
                          loss=round(loss.item() * a.accum, 4), torch=torch.__version__)), flush=True)


if __name__ == "__main__":
    main()
