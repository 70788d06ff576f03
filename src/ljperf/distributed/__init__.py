"""This process in a run: ranks, device and process group, torchrun launching, collectives and memory measurement."""
