"""mpishard.testing."""
