"""Numba-compiled batched text-game environments: Bandit, Sokoban, FrozenLake."""
