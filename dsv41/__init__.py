"""dsv41: DeepSeek-V4.1-Flash end to end in PyTorch."""

__version__ = "0.1.0"
