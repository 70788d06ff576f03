"""A run's configuration (``RunConfig``), which engine, forecast recipe and record derive from; each rank's context."""
