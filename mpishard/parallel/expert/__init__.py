"""mpishard.parallel.expert."""
