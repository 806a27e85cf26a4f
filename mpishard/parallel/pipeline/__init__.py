"""mpishard.parallel.pipeline."""
