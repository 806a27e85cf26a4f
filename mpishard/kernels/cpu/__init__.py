"""mpishard.kernels.cpu."""
