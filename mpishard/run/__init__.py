"""mpishard.run."""
