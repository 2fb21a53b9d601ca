"""Tokenizers: a dependency-free byte tokenizer (default) and a thin Hugging Face wrapper.

Both expose the same small surface, which is all the data pipeline and trainer use::

    name, vocab_size (padded to a multiple of 16), bos_id, eos_id, pad_id,
    encode(text) -> list[int], decode(ids) -> str,
    encode_documents(docs) -> 1-D int32 tensor of all documents, each followed by EOS.

The byte tokenizer maps byte b to id b (0-255) and adds BOS=256, EOS=257, PAD=258, so every
UTF-8 text round-trips exactly and the vocabulary (272 after padding) never needs training.
"""

from __future__ import annotations

import os
from typing import Iterable, Protocol, Sequence

import torch
from lowprec.errors import did_you_mean

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "BYTE_VOCAB_SIZE",
    "is_remote_code_refusal",
    "directory_error",
    "remote_code_message",
]


def _round_up16(n: int) -> int:
    return -(-n // 16) * 16


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int
    pad_id: int

    @property
    def bos_id(self) -> int | None: ...  # read-only: ByteTokenizer's is always an int

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def encode_documents(self, docs: Sequence[str | bytes]) -> torch.Tensor: ...


class ByteTokenizer:
    """ids 0-255 are bytes; 256 BOS, 257 EOS, 258 PAD; vocab_size 272 (259 padded to 16)."""

    name = "byte"
    bos_id = 256
    eos_id = 257
    pad_id = 258
    n_tokens = 259
    vocab_size = _round_up16(n_tokens)

    def encode(self, text: str | bytes, bos: bool = False, eos: bool = False) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return [self.bos_id] * bos + list(data) + [self.eos_id] * eos

    def decode(self, ids: Iterable[int]) -> str:
        """Special and padding ids are dropped; bytes that are not valid UTF-8 (a sequence
        cut mid-character, a model's sample) decode to U+FFFD instead of raising."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def encode_documents(self, docs: Sequence[str | bytes]) -> torch.Tensor:
        """All documents, each followed by EOS, as one int32 tensor, without a Python loop over
        bytes: the joined bytes go through ``torch.frombuffer`` and EOS ids are scattered in."""
        raw = [d.encode("utf-8") if isinstance(d, str) else bytes(d) for d in docs]
        if not raw:
            return torch.empty(0, dtype=torch.int32)
        lengths = torch.tensor([len(r) + 1 for r in raw], dtype=torch.int64)
        eos_at = lengths.cumsum(0) - 1
        out = torch.empty(int(lengths.sum()), dtype=torch.int32)
        is_byte = torch.ones(out.numel(), dtype=torch.bool)
        is_byte[eos_at] = False
        joined = b"".join(raw)
        if joined:
            # bytearray: frombuffer on immutable bytes warns about a non-writable buffer
            out[is_byte] = torch.frombuffer(bytearray(joined), dtype=torch.uint8).to(torch.int32)
        out[eos_at] = self.eos_id
        return out

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=272)"


BYTE_VOCAB_SIZE = ByteTokenizer.vocab_size


def is_remote_code_refusal(exc: BaseException) -> bool:
    """transformers' refusal of a directory whose ``auto_map`` names code of its own."""
    return isinstance(exc, ValueError) and "trust_remote_code=True" in str(exc)


def directory_error(exc: BaseException) -> bool:
    """An error a Hugging Face model or tokenizer directory's files cause in ``from_pretrained``: a
    missing, unreadable or malformed file, a config value of the wrong type (transformers' configs
    are huggingface_hub strict dataclasses, whose validation errors are no ValueError), an unknown
    key. The loaders turn these into one line naming their key; anything else is a bug, re-raised."""
    return isinstance(exc, (OSError, ValueError, KeyError, TypeError)) or type(exc).__module__.startswith(
        "huggingface_hub."
    )


def remote_code_message(path: str) -> str:
    return (
        f"{path} ships its own Python code (auto_map in its config), which lowprec does not run: set "
        "trust_remote_code: true only if you trust that code"
    )


class HFTokenizer:
    """A local Hugging Face tokenizer directory (``tokenizer.json`` etc.), loaded offline."""

    def __init__(
        self,
        path: str,
        special_tokens: dict | None = None,
        tokenizer_type: str | None = None,
        trust_remote_code: bool = False,
        tokens: Sequence[str] | None = None,
    ) -> None:
        try:
            import transformers
        except ImportError as e:  # None in sys.modules also lands here
            raise ValueError(
                f"tokenizer {path!r} is a Hugging Face tokenizer directory, which needs the "
                "'transformers' package; install it with `pip install transformers` "
                "or use tokenizer: byte"
            ) from e
        cls = getattr(transformers, tokenizer_type or "AutoTokenizer", None)
        if cls is None or not hasattr(cls, "from_pretrained") or "Tokenizer" not in (tokenizer_type or "AutoTokenizer"):
            names = [n for n in dir(transformers) if n.endswith(("Tokenizer", "TokenizerFast"))]
            raise ValueError(
                f"tokenizer_type: {tokenizer_type!r} is not a transformers tokenizer class"
                f"{did_you_mean(str(tokenizer_type), names)}; use AutoTokenizer or e.g. PreTrainedTokenizerFast"
            )
        try:
            # always explicit: transformers' default (None) asks "[y/N]" on a terminal, and "y" runs
            # the directory's code; unset must mean refused
            self._tok = cls.from_pretrained(path, local_files_only=True, trust_remote_code=bool(trust_remote_code))
        except Exception as exc:  # noqa: BLE001 - what the directory's files cause (else re-raised)
            if not directory_error(exc):
                raise
            if is_remote_code_refusal(exc):
                raise ValueError(remote_code_message(path)) from None
            # a damaged tokenizer.json said only "Expecting ',' delimiter: line 2 column 1": no file, no key
            raise ValueError(
                f"tokenizer: {path} cannot be loaded as a Hugging Face tokenizer "
                f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); restore its files or point "
                "tokenizer: at another directory"
            ) from None
        known = set(self._tok.get_vocab()) if special_tokens or tokens else set()
        if special_tokens:  # Axolotl's special_tokens: set (or add) before anything is tokenized
            self._tok.add_special_tokens(dict(special_tokens))
        if tokens:  # Axolotl's tokens: plain added tokens, never split
            self._tok.add_tokens(list(tokens))
        # strings the vocabulary did not have -> the key that added them; their embedding rows
        # are new (resized or never trained), which LoRA alone cannot train (adapters.check_new_tokens)
        special = dict(special_tokens or {})
        named = [(f"special_tokens.{k}", v) for k, v in special.items() if k != "additional_special_tokens"]
        named += [
            ("special_tokens.additional_special_tokens", v) for v in special.get("additional_special_tokens") or []
        ]
        named += [("tokens", v) for v in tokens or []]
        self.new_tokens = {v: k for k, v in named if v not in known}
        # the added tokens change tokenization without always changing the padded vocab_size,
        # so the prepared-data cache key includes them
        self.settings = repr((sorted((special_tokens or {}).items()), list(tokens or [])))
        self.name = f"hf:{os.path.abspath(path)}"
        eos = self._tok.eos_token_id
        if eos is None:
            raise ValueError(
                f"tokenizer {path!r} defines no eos_token; documents are joined with EOS, "
                "so set eos_token in its tokenizer_config.json"
            )
        self.eos_id = int(eos)
        self.bos_id = None if self._tok.bos_token_id is None else int(self._tok.bos_token_id)
        self.pad_id = self.eos_id if self._tok.pad_token_id is None else int(self._tok.pad_token_id)
        self.vocab_size = _round_up16(len(self._tok))

    @property
    def hf_tokenizer(self):
        """The transformers tokenizer (saved next to a trained Hugging Face model)."""
        return self._tok

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = list(self._tok.encode(text, add_special_tokens=False))
        head = [self.bos_id] if bos and self.bos_id is not None else []
        return head + ids + [self.eos_id] * eos

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]] | None:
        """``encode(text)`` with each token's ``(start, end)`` character span in ``text``; None
        for a slow (Python) tokenizer, which has no offsets."""
        if not getattr(self._tok, "is_fast", False):
            return None
        enc = self._tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [(int(a), int(b)) for a, b in enc["offset_mapping"]]

    def decode(self, ids: Iterable[int]) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def encode_documents(self, docs: Sequence[str | bytes]) -> torch.Tensor:
        texts = [d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in docs]
        ids: list[int] = []
        for row in self._tok(texts, add_special_tokens=False)["input_ids"] if texts else []:
            ids.extend(row)
            ids.append(self.eos_id)
        return torch.tensor(ids, dtype=torch.int32)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size})"


def load_tokenizer(
    spec: str | None = "byte", special_tokens: dict | None = None, tokens: Sequence[str] | None = None
) -> Tokenizer:
    """``"byte"`` (or None) for the byte tokenizer, or the path of a local Hugging Face
    tokenizer directory (needs ``transformers``); ``special_tokens`` (``{"pad_token": ...}``)
    and added ``tokens`` go to a Hugging Face tokenizer (the byte tokenizer's are fixed)."""
    if spec is None or str(spec).lower() == "byte":
        for key, value in (("special_tokens", special_tokens), ("tokens", tokens)):
            if value:
                raise ValueError(
                    f"{key}: the byte tokenizer's vocabulary and BOS/EOS/PAD are fixed; drop {key} or set "
                    "tokenizer: to a local Hugging Face tokenizer directory"
                )
        return ByteTokenizer()
    if isinstance(spec, (str, os.PathLike)) and os.path.isdir(spec):
        return HFTokenizer(os.fspath(spec), special_tokens, tokens=tokens)
    raise ValueError(
        f"tokenizer {spec!r} is neither 'byte' nor an existing directory; use tokenizer: byte "
        "or the path of a local Hugging Face tokenizer directory"
    )
