"""mpishard.models.llama."""
