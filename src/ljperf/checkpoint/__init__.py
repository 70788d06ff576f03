"""Activation checkpointing: the policies (none / selective / full / one mode per layer) and their ``apply(model)``."""
