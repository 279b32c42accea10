"""Training backends: the protocol (`base`), the factory, the CPU backend, LoRA and the verl modules."""
