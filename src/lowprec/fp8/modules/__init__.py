"""The layers swapped into a model (Linear, Conv1D, experts, frozen bases), their autograd
functions, and what they keep for backward."""
