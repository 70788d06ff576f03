"""ljperf: measure, fit and speed up LLM training on PyTorch.

Run ``ljperf --help`` for the subcommands.
"""

__version__ = "0.1.0"
