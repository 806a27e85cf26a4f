"""mpishard.parallel.data."""
