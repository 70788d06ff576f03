"""Compile optimization: regional or whole-model ``torch.compile`` with eager fallbacks; DeepSpeed's own compile."""
