"""mpishard.cli."""
