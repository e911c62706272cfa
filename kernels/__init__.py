"""Fused log-prob, entropy and clipped PPO/GRPO loss from hidden states (Triton + PyTorch)."""
