"""fastpo: a kernel-optimized trainer for multi-turn RL of LLM agents (StarPO, arXiv 2504.20073)."""

__version__ = "0.1.0"
