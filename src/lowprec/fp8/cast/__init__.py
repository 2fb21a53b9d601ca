"""FP8 formats, scale rules and casts: small pure functions on tensors, no module state."""
