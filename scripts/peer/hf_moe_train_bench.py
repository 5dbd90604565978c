#!/usr/bin/env python3
"""Peer benchmark for the Mixture-of-Experts proxies: a training loop of Hugging Face
transformers' MixtralForCausalLM (issue 20), the reference forge's MoE throughput is held
against side by side in one device run.

Same shape, batch, sequence length and optimizer as the forge run: fp32 master weights,
bf16 autocast, SDPA attention (flash), fused AdamW, random tokens, the balancing loss
off (forge's proxy sets router_aux_loss_coef 0 too), optional torch.compile. transformers
5 runs the routed experts one of three ways (`--experts`): "eager" (a loop over the
experts that were hit, with a host synchronization), "batched_mm" or "grouped_mm"
(torch._grouped_mm, one grouped GEMM over all experts); older versions have only the loop.
Prints one JSON line.

  python3 hf_moe_train_bench.py --preset mixtral-8x7b --layers 2 --seq 4096 --experts grouped_mm --compile

Model FLOPs per token = 6 * (active parameters - input embedding) + 6 * layers * dim * seq,
active parameters counting num_experts_per_tok of the experts (shared/PERF.md; forge's
ModelConfig::flops_per_token).
"""
import argparse, json, time
import torch

PRESETS = {  # vocab, dim, layers, heads, kv_heads, ffn per expert, experts, top-k, rope_theta
    "mixtral-8x7b": (32000, 4096, 32, 32, 8, 14336, 8, 2, 1e6),
    "mixtral-8x22b": (32768, 6144, 56, 48, 8, 16384, 8, 2, 1e6),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="mixtral-8x7b", choices=PRESETS)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--experts", default="grouped_mm", help="transformers' experts_implementation")
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    import transformers
    from transformers import MixtralConfig, MixtralForCausalLM
    V, d, L, H, KV, F, E, K, theta = PRESETS[a.preset]
    L = a.layers or L
    cfg = MixtralConfig(vocab_size=V, hidden_size=d, num_hidden_layers=L, num_attention_heads=H,
                        num_key_value_heads=KV, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K,
                        rope_theta=theta, max_position_embeddings=a.seq, tie_word_embeddings=False, use_cache=False,
                        sliding_window=None, output_router_logits=False, router_aux_loss_coef=0.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).cuda()
    experts = "eager"  # a transformers without experts implementations runs the loop
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(a.experts)
        experts = model.config._experts_implementation
    n_params = sum(p.numel() for p in model.parameters())
    n_emb = model.model.embed_tokens.weight.numel()
    idle = L * (E - K) * 3 * d * F
    active = n_params - idle
    flops_per_token = 6 * (active - n_emb) + 6 * L * d * a.seq
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    fwd = torch.compile(model) if a.compile else model
    ids = torch.randint(0, V, (a.batch, a.seq), device="cuda")

    def step():
        for _ in range(a.accum):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fwd(input_ids=ids, labels=ids).loss / a.accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    median = times[len(times) // 2]
    tokens = a.batch * a.seq * a.accum
    tps = tokens / median
    print(json.dumps({
        "peer": "hf_moe_train_bench", "preset": a.preset, "layers": L, "seq": a.seq, "batch": a.batch,
        "accum": a.accum, "compile": a.compile, "experts": experts, "transformers": transformers.__version__,
        "torch": torch.__version__, "params": n_params, "active_params": active, "step_s": median,
        "tokens_per_s": tps, "model_tflops": tps * flops_per_token / 1e12,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "loss": float(loss) * a.accum,
    }))


if __name__ == "__main__":
    main()
