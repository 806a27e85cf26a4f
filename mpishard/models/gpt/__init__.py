"""mpishard.models.gpt."""
