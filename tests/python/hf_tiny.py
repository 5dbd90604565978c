"""Tiny random Hugging Face models for the reference tests: forge's debug-tiny shape as a
transformers config, and a seeded Llama or Mistral whose weights are large enough to
exercise every path (N(0, 0.3) matrices; norm weights 1 + N(0, 0.1), so they are not all
ones); and an editor of saved PEFT adapters, for the tests of bad ones."""
import json
import os

import torch
from safetensors.torch import load_file, save_file
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


def edit_peft_adapter(adapter_dir, edit_config=None, edit_tensors=None):
    """Edits a saved PEFT adapter in place: edit_config(dict) changes adapter_config.json's
    values, edit_tensors(dict) adapter_model.safetensors' tensors."""
    if edit_config:
        path = os.path.join(adapter_dir, "adapter_config.json")
        with open(path) as f:
            config = json.load(f)
        edit_config(config)
        with open(path, "w") as f:
            json.dump(config, f)
    if edit_tensors:
        path = os.path.join(adapter_dir, "adapter_model.safetensors")
        tensors = load_file(path)
        edit_tensors(tensors)
        save_file(tensors, path)
