"""Real data shipped in PyPI packages: ShareGPT conversations."""

from .sharegpt import Conversation, iter_sharegpt, load_sharegpt, sharegpt_path

__all__ = ["Conversation", "iter_sharegpt", "load_sharegpt", "sharegpt_path"]
