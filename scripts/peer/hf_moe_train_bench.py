#!/usr/bin/env python3
"""Peer benchmark for the Mixture-of-Experts proxies: a training loop of Hugging Face
transformers' MixtralForCausalLM or DeepseekV2ForCausalLM (issue 20), the reference forge's
MoE throughput is held against side by side in one device run.

Same shape, batch, sequence length and optimizer as the forge run: fp32 master weights,
bf16 autocast, SDPA attention, fused AdamW, random tokens, the balancing loss off (forge's
proxies set router_aux_loss_coef 0 too; transformers' DeepseekV2ForCausalLM computes none
at all), optional torch.compile. transformers 5 runs the routed experts one of three ways
(`--experts`): "eager" (a loop over the experts that were hit, with a host
synchronization), "batched_mm" or "grouped_mm" (torch._grouped_mm, one grouped GEMM over
all experts); older versions have only the loop. Prints one JSON line; "sdpa_backend" is
the kernel PyTorch's SDPA priority order picks for the attention's shapes (flash needs the
query/key and value head dims equal, which DeepSeek's MLA, 192 and 128, are not).

  python3 hf_moe_train_bench.py --preset mixtral-8x7b --layers 2 --seq 4096 --experts grouped_mm --compile
  python3 hf_moe_train_bench.py --preset deepseek-v2-lite --layers 4 --seq 4096 --experts grouped_mm

Presets:
- mixtral-8x7b, mixtral-8x22b: MixtralConfig with the published dimensions.
- deepseek-v2-lite: DeepseekV2Config with deepseek-ai/DeepSeek-V2-Lite's config.json
  (27 layers, the first dense with FFN 10944, the others 64 routed experts of 1408, top-6
  greedy softmax routing without renormalization, 2 shared experts; MLA without a query
  LoRA, kv_lora_rank 512, head dims 128 + 64 rope for query/key and 128 for value; YaRN
  RoPE factor 40 over 4096; vocab 102400, untied output). `--layers 4` keeps layer 0
  dense and makes 1-3 MoE.

Model FLOPs per token = 6 * (active parameters - input embedding) + attention, active
parameters counting num_experts_per_tok of the routed experts in the MoE layers (the dense
layers, shared experts and routers always count); attention is 6 * layers * dim * seq for
Mixtral and 6 * layers * seq * heads * (qk_head_dim + v_head_dim) / 2 for MLA, the same
thing when the two head dims are dim / heads (shared/PERF.md; forge's
ModelConfig::flops_per_token).

`--device cpu` and `--tiny` (small dimensions, same structure) are for a smoke test off
the GPU: `--preset deepseek-v2-lite --tiny --layers 2 --seq 64 --device cpu --steps 2`.
"""
import argparse, json, time
import torch

PRESETS = {  # vocab, dim, layers, heads, kv_heads, ffn per expert, experts, top-k, rope_theta
    "mixtral-8x7b": (32000, 4096, 32, 32, 8, 14336, 8, 2, 1e6),
    "mixtral-8x22b": (32768, 6144, 56, 48, 8, 16384, 8, 2, 1e6),
}
MIXTRAL_TINY = dict(V=1024, d=128, H=4, KV=2, F=256)  # experts and top-k stay

DEEPSEEK_PRESETS = {  # DeepseekV2Config keys as deepseek-ai/DeepSeek-V2-Lite's config.json has them
    "deepseek-v2-lite": dict(
        vocab_size=102400, hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64, num_experts_per_tok=6,
        n_shared_experts=2, first_k_dense_replace=1, norm_topk_prob=False,
        routed_scaling_factor=1.0, topk_method="greedy", n_group=1, topk_group=1, q_lora_rank=None,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000,
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
        attention_bias=False),
}
DEEPSEEK_TINY = dict(vocab_size=1024, hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
                     intermediate_size=256, moe_intermediate_size=64, n_routed_experts=16, kv_lora_rank=64,
                     qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)  # top-6, 2 shared, MLA, YaRN stay


def build_mixtral(a):
    from transformers import MixtralConfig, MixtralForCausalLM
    V, d, L, H, KV, F, E, K, theta = PRESETS[a.preset]
    if a.tiny:
        V, d, H, KV, F = (MIXTRAL_TINY[k] for k in ("V", "d", "H", "KV", "F"))
    L = a.layers or L
    cfg = MixtralConfig(vocab_size=V, hidden_size=d, num_hidden_layers=L, num_attention_heads=H,
                        num_key_value_heads=KV, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K,
                        rope_theta=theta, max_position_embeddings=a.seq, tie_word_embeddings=False, use_cache=False,
                        sliding_window=None, output_router_logits=False, router_aux_loss_coef=0.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).to(a.device)
    n_params = sum(p.numel() for p in model.parameters())
    n_emb = model.model.embed_tokens.weight.numel()
    idle = L * (E - K) * 3 * d * F
    active = n_params - idle
    flops_per_token = 6 * (active - n_emb) + 6 * L * d * a.seq
    attn_shapes = (H, KV, d // H, d // H)  # query heads, key/value heads, qk and v head dims
    return model, V, L, n_params, active, flops_per_token, attn_shapes


def build_deepseek(a):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    keys = dict(DEEPSEEK_PRESETS[a.preset], **(DEEPSEEK_TINY if a.tiny else {}))
    if a.layers:
        keys["num_hidden_layers"] = a.layers
    cfg = DeepseekV2Config(**keys, use_cache=False, output_router_logits=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = DeepseekV2ForCausalLM(cfg).to(a.device)
    L, d, H = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads
    E, K, F = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    qk_head_dim, v_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    n_params = sum(p.numel() for p in model.parameters())
    n_emb = model.model.embed_tokens.weight.numel()
    moe_layers = sum(1 for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    idle = moe_layers * (E - K) * 3 * d * F
    active = n_params - idle
    flops_per_token = 6 * (active - n_emb) + 6 * L * a.seq * H * (qk_head_dim + v_head_dim) / 2
    attn_shapes = (H, cfg.num_key_value_heads, qk_head_dim, v_head_dim)
    return model, cfg.vocab_size, L, n_params, active, flops_per_token, attn_shapes


def sdpa_backend(device, batch, seq, shapes):
    """The SDPA kernel PyTorch picks for these shapes (bf16, causal, no mask): the first
    eligible in its priority order. transformers passes enable_gqa when the key/value heads
    are fewer and the head dims equal (integrations/sdpa_attention.py, use_gqa_in_sdpa)."""
    if device != "cuda":
        return device
    try:
        from torch.nn.attention import SDPBackend
        H, KV, qk, v = shapes
        gqa = KV != H and qk == v
        q = torch.empty(batch, H, seq, qk, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(batch, KV if gqa else H, seq, qk, device="cuda", dtype=torch.bfloat16)
        val = torch.empty(batch, KV if gqa else H, seq, v, device="cuda", dtype=torch.bfloat16)
        params = torch.backends.cuda.SDPAParams(q, k, val, None, 0.0, True, gqa)
        can = {SDPBackend.FLASH_ATTENTION: torch.backends.cuda.can_use_flash_attention,
               SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.can_use_efficient_attention,
               SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.can_use_cudnn_attention,
               SDPBackend.MATH: lambda p, debug: True}
        for b in torch._C._get_sdp_priority_order():
            b = SDPBackend(b)
            if b in can and can[b](params, False):
                return b.name.lower()
    except Exception as e:  # an older PyTorch without these helpers
        return f"unknown ({type(e).__name__})"
    return "none"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="mixtral-8x7b", choices=list(PRESETS) + list(DEEPSEEK_PRESETS))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--experts", default="grouped_mm", help="transformers' experts_implementation")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="small dimensions for a smoke test (not a benchmark)")
    a = ap.parse_args()
    import transformers
    build = build_deepseek if a.preset in DEEPSEEK_PRESETS else build_mixtral
    model, V, L, n_params, active, flops_per_token, attn_shapes = build(a)
    cuda = a.device == "cuda"
    experts = "eager"  # a transformers without experts implementations runs the loop
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(a.experts)
        experts = model.config._experts_implementation
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    fwd = torch.compile(model) if a.compile else model
    ids = torch.randint(0, V, (a.batch, a.seq), device=a.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step():
        for _ in range(a.accum):
            with torch.autocast(a.device, dtype=torch.bfloat16):
                loss = fwd(input_ids=ids, labels=ids).loss / a.accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(a.warmup):
        step()
    sync()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = step()
        sync()
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
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, "loss": float(loss.detach()) * a.accum,
        "flops_per_token": flops_per_token, "sdpa_backend": sdpa_backend(a.device, a.batch, a.seq, attn_shapes),
        "device": a.device, "tiny": a.tiny,
    }))


if __name__ == "__main__":
    main()
