"""``ljperf comm``: collectives timed and checked as nccl-tests does."""
