"""mpishard.core."""
