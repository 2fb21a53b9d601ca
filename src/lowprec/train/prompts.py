"""Axolotl's dataset types: one data row -> ``(input_ids, labels)``, prompt tokens labelled -100.

==============  ==========================================  ==================================
type            row                                         trained tokens
==============  ==========================================  ==================================
completion      ``{field: text}`` (field default ``text``)  all (long texts cut in pieces)
alpaca          ``instruction``, ``input`` (optional),      the response and EOS
                ``output``
input_output    ``segments: [{text, label}]``               segments with ``label: true``
chat_template   ``messages: [{role, content}]``             turns of ``roles_to_train``
(none)          ``input_ids`` (+ ``labels``)                as given (pre-tokenized)
==============  ==========================================  ==================================

Every type first becomes text segments ``[(text, trained)]``. ``alpaca`` and ``chat_template``
tokenize the whole text at once, as Axolotl does (prompt + response; the rendered conversation),
so the ids are exactly the tokenizer's encoding of that text (a SentencePiece-style tokenizer
adds no space token at a segment boundary); the fast tokenizer's character offsets then give each
token its segment: the one holding the token's first non-whitespace character (``"▁how"`` after
``"[/INST] "`` belongs to the answer ``"how"``), or, for a token of whitespace only, the one where
it starts. The byte tokenizer and a tokenizer without offsets (a slow Hugging Face tokenizer,
logged once) tokenize each segment on its own and concatenate (exact for the byte tokenizer).
``input_output`` always tokenizes segment by segment (as Axolotl documents for it).
``train_on_inputs: true`` trains every token (the chat template's roles included).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence
from lowprec.train.chat_templates import render_segments

__all__ = [
    "PromptOptions",
    "row_segments",
    "tokenize_row",
    "row_type_hint",
    "row_roles",
    "check_vocab",
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_NO_INPUT",
    "IGNORE",
]

IGNORE = -100
logger = logging.getLogger("lowprec")
_WHOLE_TEXT_TYPES = ("alpaca", "chat_template")  # tokenized as one text, masked by character offsets
_NOTED_SLOW: set[str] = set()  # tokenizers already logged as tokenized per segment
# the Stanford Alpaca prompt (as Axolotl's `type: alpaca` writes it)
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
_DEFAULT_ROLES = {
    "user": ["human", "user"],
    "assistant": ["gpt", "assistant", "model"],
    "system": ["system"],
    "tool": ["tool"],
}


@dataclass(frozen=True)
class PromptOptions:
    """What turns a row into tokens, besides the row: one dataset entry plus top-level keys."""

    type: str
    field: str = "text"
    train_on_inputs: bool = False
    chat_template: str = ""  # Jinja source, resolved by chat_templates.template_text
    field_messages: str = "messages"
    role_key: str = "role"
    content_key: str = "content"
    roles: dict[str, list[str]] = dataclasses.field(default_factory=lambda: dict(_DEFAULT_ROLES))
    roles_to_train: tuple[str, ...] = ("assistant",)
    train_on_eos: str = "turn"
    drop_system_message: bool = False
    eot_tokens: tuple[str, ...] = ()


def row_type_hint(row: dict[str, Any]) -> str:
    """``" (these look like alpaca rows: type: alpaca)"`` where the row's keys name a type, else ''."""
    if "instruction" in row and "output" in row:
        return " (these look like alpaca rows: type: alpaca)"
    if "messages" in row or "conversations" in row:
        return " (these look like chat rows: type: chat_template)"
    return ""


def _need(row: dict[str, Any], key: str, where: str, kind: str) -> Any:
    if key not in row:
        fix = (
            f"set datasets[].field to the field that holds the text{row_type_hint(row)}"
            if kind == "completion"
            else f"type: {kind} rows need it"
        )
        raise ValueError(f"{where}: no {key!r} field (keys: {sorted(row)}); {fix}")
    return row[key]


def _text(value: Any, key: str, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def row_segments(row: dict[str, Any], opt: PromptOptions, where: str, tokenizer: Any = None) -> list[tuple[str, bool]]:
    """The row as ``[(text, trained)]`` (not for pre-tokenized rows)."""
    kind = opt.type
    if kind == "completion":
        return [(_text(_need(row, opt.field, where, kind), opt.field, where), True)]
    if kind == "alpaca":
        instruction = _text(_need(row, "instruction", where, kind), "instruction", where)
        output = _text(_need(row, "output", where, kind), "output", where)
        extra = _text(row.get("input"), "input", where)
        prompt = (ALPACA_PROMPT if extra.strip() else ALPACA_PROMPT_NO_INPUT).format(
            instruction=instruction, input=extra
        )
        return [(prompt, False), (output, True)]
    if kind == "input_output":
        segs = _need(row, "segments", where, kind)
        if not isinstance(segs, list) or not all(isinstance(s, dict) and "text" in s for s in segs):
            raise ValueError(f"{where}: 'segments' must be a list of {{text, label}} objects")
        return [(_text(s["text"], "text", where), bool(s.get("label", True))) for s in segs]
    if kind == "chat_template":
        messages = _messages(row, opt, where)
        trained = tuple(opt.roles_to_train) if not opt.train_on_inputs else tuple({m["role"] for m in messages})
        tok = getattr(tokenizer, "_tok", None)  # the HF tokenizer's own special-token strings
        return render_segments(
            opt.chat_template,
            messages,
            trained,
            opt.train_on_eos,
            bos_token=getattr(tok, "bos_token", None) or "",
            eos_token=getattr(tok, "eos_token", None) or "",
            eot_tokens=opt.eot_tokens,
        )
    raise ValueError(f"unknown dataset type {kind!r}")


def row_roles(row: dict[str, Any], opt: PromptOptions, where: str) -> set[str]:
    """The roles of a chat row's messages after the ``roles`` mapping."""
    return {m["role"] for m in _messages(row, opt, where)}


def _messages(row: dict[str, Any], opt: PromptOptions, where: str) -> list[dict[str, str]]:
    raw = row.get(opt.field_messages)
    if raw is None:
        hint = (
            " (ShareGPT data: set field_messages: conversations and message_property_mappings: {role: from, content: value})"
            if "conversations" in row
            else ""
        )
        raise ValueError(f"{where}: no {opt.field_messages!r} field (keys: {sorted(row)}){hint}")
    if not isinstance(raw, list):
        raise ValueError(f"{where}: {opt.field_messages!r} must be a list of messages")
    to_role = {alias: role for role, aliases in opt.roles.items() for alias in aliases}
    out = []
    for j, m in enumerate(raw):
        if not isinstance(m, dict) or opt.role_key not in m:
            raise ValueError(
                f"{where}: message {j} has no {opt.role_key!r} (set message_property_mappings: {{role: <key>}})"
            )
        role: Any = to_role.get(m[opt.role_key], m[opt.role_key])  # an alias's role, else the row's value as is
        if role == "system" and opt.drop_system_message:
            continue
        out.append({"role": role, "content": _text(m.get(opt.content_key), opt.content_key, where)})
    return out


def tokenize_row(row: dict[str, Any], opt: PromptOptions, tokenizer: Any, where: str) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one row; labels are -100 where the loss must not look."""
    if opt.type == "pretokenized":
        given = _need(row, "input_ids", where, "pre-tokenized (no type:)")
        given_labels = row.get("labels", given)
        if not isinstance(given, (list, tuple)) or len(given_labels) != len(given):
            raise ValueError(f"{where}: input_ids must be a list of token ids and labels (if given) as long")
        return [int(i) for i in given], [int(i) for i in given_labels]
    ids: list[int] = []
    labels: list[int] = []
    if opt.type in ("completion", "alpaca") and tokenizer.bos_id is not None:
        ids.append(tokenizer.bos_id)
        labels.append(tokenizer.bos_id if opt.type == "completion" or opt.train_on_inputs else IGNORE)
    segments = row_segments(row, opt, where, tokenizer)
    whole = _encode_whole(segments, tokenizer) if opt.type in _WHOLE_TEXT_TYPES else None
    if whole is None:
        whole = _encode_each(segments, tokenizer)
    for tok_id, trained in zip(*whole):
        ids.append(tok_id)
        labels.append(tok_id if (trained or opt.train_on_inputs) else IGNORE)
    if opt.type in ("completion", "alpaca"):  # the model learns to stop
        ids.append(tokenizer.eos_id)
        labels.append(tokenizer.eos_id)
    return ids, labels


def _encode_each(segments: Sequence[tuple[str, bool]], tokenizer: Any) -> tuple[list[int], list[bool]]:
    """Each segment tokenized on its own, concatenated: the mask follows segment boundaries."""
    ids: list[int] = []
    flags: list[bool] = []
    for text, trained in segments:
        part = tokenizer.encode(text)
        ids += part
        flags += [trained] * len(part)
    return ids, flags


def _encode_whole(segments: Sequence[tuple[str, bool]], tokenizer: Any) -> Optional[tuple[list[int], list[bool]]]:
    """The joined text tokenized once, each token flagged by the segment of its first
    non-whitespace character (whitespace-only tokens: where they start); None where the
    tokenizer gives no offsets (the byte tokenizer, exact per segment; a slow HF tokenizer)."""
    encode = getattr(tokenizer, "encode_with_offsets", None)
    if encode is None or not segments:
        return None
    text = "".join(t for t, _ in segments)
    got = encode(text)
    if got is None:
        if tokenizer.name not in _NOTED_SLOW:
            _NOTED_SLOW.add(tokenizer.name)
            logger.info(
                "lowprec: note: %s is not a fast tokenizer (no character offsets), so prompt and response "
                "are tokenized separately; a SentencePiece tokenizer may add a space token where they meet",
                tokenizer.name,
            )
        return None
    ids, offsets = got
    ends: list[int] = []
    for t, _ in segments:
        ends.append((ends[-1] if ends else 0) + len(t))
    flags = []
    for start, end in offsets:
        piece = text[start:end]
        at = start + (len(piece) - len(piece.lstrip())) if piece.strip() else start
        flags.append(segments[min(bisect.bisect_right(ends, at), len(segments) - 1)][1])
    return list(ids), flags


def check_vocab(ids: Sequence[int], vocab_size: int, where: str) -> Optional[str]:
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    return None if bad is None else f"{where}: token id {bad} is outside the tokenizer's vocabulary (size {vocab_size})"
