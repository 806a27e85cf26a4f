"""mpishard.kernels.cuda."""
