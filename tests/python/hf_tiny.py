"""Tiny random Hugging Face models for the reference tests: forge's debug-tiny shape as a
transformers config, and a seeded Llama, Mistral, Mixtral or DeepSeek-V2/V3 whose weights are
large enough to exercise every path (N(0, 0.3) matrices; norm weights 1 + N(0, 0.1), so they
are not all ones; DeepSeek's routers spread wider and V3's routing bias random, so no token's
choice is a near tie); Mixtral's and DeepSeek's in-memory tensors under the published
checkpoints' names; DeepSeek's rotary rows in forge's order; and an editor of saved PEFT
adapters, for the tests of bad ones."""
import json
import os

import torch
from safetensors.torch import load_file, save_file
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM,
                          LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig,
                          MixtralForCausalLM)

ROPE = {"rope_type": "default", "rope_theta": 10000.0}
DEBUG_TINY = dict(vocab_size=32, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False,
                  rope_parameters=ROPE)


FAMILIES = {"llama": (LlamaForCausalLM, LlamaConfig), "mistral": (MistralForCausalLM, MistralConfig),
            "mixtral": (MixtralForCausalLM, MixtralConfig), "deepseek_v2": (DeepseekV2ForCausalLM, DeepseekV2Config),
            "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config)}


def random_model(family, config, seed, router_std=1.0, bias_std=0.1):
    """A seeded "llama", "mistral", "mixtral", "deepseek_v2" or "deepseek_v3" with eager attention
    (and eager experts), fp32, in eval mode. DeepSeek's routers are N(0, router_std) and V3's
    routing bias N(0, bias_std)."""
    torch.manual_seed(seed)
    cls, cfg = FAMILIES[family]
    extra = {"experts_implementation": "eager"} if family != "llama" and family != "mistral" else {}
    model = cls(cfg(attn_implementation="eager", **extra, **config))
    deepseek = family.startswith("deepseek")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif deepseek and name.endswith(".mlp.gate.weight"):
                p.normal_(0.0, router_std)
            else:
                p.normal_(0.0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, bias_std)
    return model.float().eval()


def deepseek_published_names(tensors):
    """transformers 5's in-memory DeepSeek expert stacks (mlp.experts.gate_up_proj [E, 2F, H],
    mlp.experts.down_proj [E, H, F]) under the published checkpoints' per-expert names, which
    its save_pretrained writes: mlp.experts.e.gate_proj / up_proj / down_proj. Other tensors
    (the router mlp.gate.weight, e_score_correction_bias, shared experts) keep their names."""
    out = {}
    for name, t in tensors.items():
        block = name[:name.find(".mlp.") + 1]
        if name.endswith(".mlp.experts.gate_up_proj"):
            ffn = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{block}mlp.experts.{e}.gate_proj.weight"] = t[e, :ffn]
                out[f"{block}mlp.experts.{e}.up_proj.weight"] = t[e, ffn:]
        elif name.endswith(".mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{block}mlp.experts.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def rotate_half_rows(t, rotary):
    """A Hugging Face tensor's rows in forge's order: rotary = [period, first, count]
    (HfTensor::rotary_rows, as forge_model_reference's specs.json gives it): in every block of
    `period` rows, forge's row first + j is the tensor's first + 2j and forge's first + count/2 + j
    the tensor's first + 2j + 1 (DeepSeek's interleaved rotary pairs to rotate-half halves)."""
    period, first, count = rotary
    if period == 0:
        return t
    order = list(range(t.shape[0]))
    for block in range(0, t.shape[0], period):
        for j in range(count // 2):
            order[block + first + j] = block + first + 2 * j
            order[block + first + count // 2 + j] = block + first + 2 * j + 1
    return t[order]


def published_names(tensors):
    """transformers 5's in-memory Mixtral tensors (per block mlp.gate.weight, the stacks
    mlp.experts.gate_up_proj [E, 2F, H] and mlp.experts.down_proj [E, H, F]) under the names
    of the published checkpoints, which its save_pretrained writes: block_sparse_moe.gate.weight
    and per expert e block_sparse_moe.experts.e.w1 (gate), .w3 (up) and .w2 (down). Other
    tensors keep their names."""
    out = {}
    for name, t in tensors.items():
        block = name[:name.find(".mlp.") + 1]
        if name.endswith(".mlp.gate.weight"):
            out[block + "block_sparse_moe.gate.weight"] = t
        elif name.endswith(".mlp.experts.gate_up_proj"):
            ffn = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{block}block_sparse_moe.experts.{e}.w1.weight"] = t[e, :ffn]
                out[f"{block}block_sparse_moe.experts.{e}.w3.weight"] = t[e, ffn:]
        elif name.endswith(".mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{block}block_sparse_moe.experts.{e}.w2.weight"] = t[e]
        else:
            out[name] = t
    return out


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
