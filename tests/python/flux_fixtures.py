"""Shared by the FLUX reference tests and the coloured-shapes demonstration: random weights
for tiny diffusers/transformers models that keep activations of order one."""
import torch


def randomize(model, seed):
    """Matrices Normal(0, 1/fan_in), 1-D weights (norm scales) 1 + Normal(0, 0.2), the rest
    (biases) Normal(0, 0.2); float32 values. Returns the model."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, (1.0 / p[0].numel()) ** 0.5)
            elif name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    return model
