"""Activation checkpointing applied to a model: one mode (none / selective / full) per repeated block."""
