"""mpishard.parallel.zero."""
