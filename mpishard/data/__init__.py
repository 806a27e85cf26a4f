"""mpishard.data."""
