"""mpishard.config."""
