"""mpishard.parallel.context."""
