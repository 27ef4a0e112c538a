"""Models the chapters train end to end: `gpt` is chapter 7's tiny GPT (from chapters 3 and 5's layers)."""
from .gpt import GPTConfig, gpt_layers, gpt_loss, parallel_layers

__all__ = ["GPTConfig", "gpt_layers", "gpt_loss", "parallel_layers"]
