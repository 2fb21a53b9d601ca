"""The built-in training pieces: a Llama-style model, a byte tokenizer and a bundled corpus.

Import the submodules directly (``lowprec.train.model``, ``.tokenizer``, ``.data``); this file
stays empty of imports so that ``import lowprec.train.model`` needs nothing but torch.
"""

__all__: list[str] = []
