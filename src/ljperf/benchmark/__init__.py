"""``ljperf benchmark``: the timed training loop, its data, metrics, memory check and forecast, record and table."""
