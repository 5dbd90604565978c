"""Tiny random Hugging Face models for the reference tests: forge's debug-tiny shape as a
transformers config, and a seeded Llama or Mistral whose weights are large enough to
exercise every path (N(0, 0.3) matrices; norm weights 1 + N(0, 0.1), so they are not all
ones)."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

ROPE = {"rope_type": "default", "rope_theta": 10000.0}
DEBUG_TINY = dict(vocab_size=32, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False,
                  rope_parameters=ROPE)


def random_model(family, config, seed):
    """A seeded "llama" or "mistral" with eager attention, fp32, in eval mode."""
    torch.manual_seed(seed)
    cls, cfg = (MistralForCausalLM, MistralConfig) if family == "mistral" else (LlamaForCausalLM, LlamaConfig)
    model = cls(cfg(attn_implementation="eager", **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.3)
    return model.float().eval()
