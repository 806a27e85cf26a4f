"""mpishard.models.qwen2: Qwen2, a Llama with q/k/v biases (its spec in spec.py)."""
