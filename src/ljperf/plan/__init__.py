"""``ljperf plan``: the memory forecast of a recipe on a device, as a record and a table."""
