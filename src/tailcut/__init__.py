"""tailcut: over-sampled, cut-off multi-turn RL rollouts."""

__version__ = "0.1.0"
