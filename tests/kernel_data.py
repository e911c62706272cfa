"""What the kernel tests share: seeded random LM-head inputs (hidden states, weight, targets)."""
import math

import torch


def lm_head_data(n, h, v, dtype=torch.float32, seed=0, scale=1.0):
    """Hidden states [n, h] (x scale), an LM-head weight [v, h] (/ sqrt(h)) drawn in float64 and
    cast to `dtype`, and int64 targets [n] in [0, v); the same values for the same arguments."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g, dtype=torch.float64) * scale).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) / math.sqrt(h)).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets
