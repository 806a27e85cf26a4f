"""mpishard.parallel.tensor."""
