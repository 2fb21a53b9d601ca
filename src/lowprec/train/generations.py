"""Sample generations at each evaluation (``eval_table_size`` / ``eval_max_new_tokens``, Axolotl's keys).

The prompts are chosen once, from the validation set, evenly spaced over it (example or block
``i * n // m`` of ``n``, ``m = min(eval_table_size, n)``), so every evaluation continues the same
prompts and the table reads as the model learning. A prompt is what the model is not trained
to produce: the tokens before an example's first trained token (the instruction, the user
turn), or the first half when every token is trained (completion text, ``train_on_inputs:
true``, the token stream of plain text); the reference is what follows, cut to
``eval_max_new_tokens``. Prompts keep their last ``width - eval_max_new_tokens`` tokens.

Generation is greedy (argmax, as Axolotl's ``LogPredictionCallback``), stops at EOS, and runs
the model being trained in eval mode under ``torch.no_grad``, as the validation loss does: the
same prepared model (DDP, FSDP2, tensor parallel: every process runs it, since the sharded
forward needs them all; only the main process writes), FP8 layers as in evaluation (high
precision unless the recipe says ``use_during_eval``). Each step runs one forward of a fixed
``(rows, width)`` buffer, right-padded: a causal model's logits at position t do not depend on
the padding after it, so one shape serves every step (no recompilation under torch.compile,
lengths FP8 GEMMs and sequence parallelism accept), at no more memory than an evaluation batch.
"""

from __future__ import annotations

import html
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from lowprec.decision import Decision

__all__ = ["EvalTable", "choose_prompts", "greedy_generate", "render_markdown", "TABLE_FILE"]

TABLE_FILE = "eval_generations.md"
DEFAULT_MAX_NEW_TOKENS = 128  # Axolotl's default
IGNORE = -100


def _round16(n: int) -> int:
    return -(-n // 16) * 16


def choose_prompts(loader: Any, k: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(index, prompt ids, reference ids) for ``k`` items of a validation loader, evenly spaced:
    examples of an :class:`~lowprec.train.examples.ExampleBatches` (their labels split prompt
    from reference), blocks of a :class:`~lowprec.train.data.TokenBatches` (halves)."""
    examples = getattr(loader, "examples", None)
    n = len(examples) if examples is not None else loader.n_blocks
    m = min(k, n)
    out = []
    for index in (i * n // m for i in range(m)):
        if examples is not None:
            ids, labels = examples.example(index)
            trained = (labels != IGNORE).nonzero()
            first = int(trained[0]) if trained.numel() else 0
        else:
            ids = loader.block(index)
            first = 0
        if first == 0:  # no untrained prefix: the first half is the prompt
            first = max(1, ids.numel() // 2)
        out.append((index, ids[:first].long(), ids[first:].long()))
    return out


@torch.no_grad()
def greedy_generate(
    model: torch.nn.Module,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    width: int,
    rows: int,
    eos_id: int,
    pad_id: int,
    device: torch.device,
    stop_early: bool = True,
) -> list[list[int]]:
    """Greedy continuations (token ids, EOS excluded) of ``prompts`` (each at most ``width -
    max_new_tokens`` long), ``rows`` prompts per forward of a ``(rows, width)`` buffer.
    ``stop_early``: stop once every row has ended; off under several processes, where a
    sharded forward is a collective and every process must run the same number of them
    whatever its own argmax says."""
    out: list[list[int]] = []
    for start in range(0, len(prompts), rows):
        chunk = prompts[start : start + rows]
        buf = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        ends = [p.numel() for p in chunk]
        for r, p in enumerate(chunk):
            buf[r, : ends[r]] = p
        buf = buf.to(device)
        new: list[list[int]] = [[] for _ in chunk]
        live = [True] * len(chunk)
        for _ in range(max_new_tokens):
            logits = model(input_ids=buf).logits
            at = torch.tensor([e - 1 for e in ends], device=logits.device)
            nxt = logits[torch.arange(len(chunk), device=logits.device), at].argmax(-1).tolist()
            for r, tok in enumerate(nxt):
                if not live[r]:
                    continue
                if tok == eos_id:
                    live[r] = False
                    continue
                new[r].append(tok)
                buf[r, ends[r]] = tok
                ends[r] += 1
                live[r] = ends[r] < width
            if stop_early and not any(live):
                break
        out += new
    return out


def _cell(text: str, limit: Optional[int] = None) -> str:
    """Text as one Markdown table cell: HTML-escaped, ``|`` escaped, line breaks as <br>; a
    long prompt keeps its end (what the model continues)."""
    if limit is not None and len(text) > limit:
        text = "…" + text[-limit:]
    text = html.escape(text.replace("\r\n", "\n").replace("\t", "    ")).replace("|", "\\|")
    text = re.sub(r"(?m)^ | (?= )", "&nbsp;", text)  # indentation and runs of spaces survive Markdown
    return text.replace("\n", "<br>")


def render_section(record: dict[str, Any]) -> str:
    """One evaluation's table (a ``generations`` record) as Markdown."""
    lines = [f"## step {record['step']}", "", "| # | prompt | reference | generated |", "|---|---|---|---|"]
    for s in record["samples"]:
        lines.append(
            f"| {s['index']} | {_cell(s['prompt'], 600)} | {_cell(s['reference'])} | {_cell(s['generated'])} |"
        )
    return "\n".join(lines) + "\n"


def render_markdown(records: Sequence[dict[str, Any]], title: str) -> str:
    head = (
        f"# Sample generations: {title}\n\nGreedy, at each evaluation, for the same validation prompts "
        "(`eval_table_size`, `eval_max_new_tokens`); every field is in metrics.jsonl (kind: generations).\n\n"
    )
    return head + "\n".join(render_section(r) for r in records)


@dataclass
class EvalTable:
    """The prompts of a run and the tables written so far (read back from metrics.jsonl on resume)."""

    samples: list[tuple[int, torch.Tensor, torch.Tensor]]
    max_new_tokens: int
    width: int
    rows: int
    tokenizer: Any
    path: str
    title: str
    records: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def build(
        cls, cfg: Any, val_loader: Any, tokenizer: Any, output_dir: str, title: str, decisions: dict, log: Any
    ) -> "EvalTable":
        if cfg.eval_max_new_tokens is not None:
            new, why = cfg.eval_max_new_tokens, "eval_max_new_tokens"
        else:
            new = min(DEFAULT_MAX_NEW_TOKENS, cfg.sequence_len // 2)
            why = (
                "default 128 (Axolotl's)"
                if new == DEFAULT_MAX_NEW_TOKENS
                else f"default 128 (Axolotl's), capped at half of sequence_len: {cfg.sequence_len}"
            )
        decisions["eval_max_new_tokens"] = Decision(new, why)
        samples = choose_prompts(val_loader, cfg.eval_table_size)  # at least one: a validation loader has a batch
        if len(samples) < cfg.eval_table_size:
            log.warning(
                "lowprec: note: eval_table_size: %d but the validation set has %d item(s); generating for all of them",
                cfg.eval_table_size,
                len(samples),
            )
        keep = cfg.sequence_len - new
        samples = [(i, p[-keep:], ref[:new]) for i, p, ref in samples]
        need = max(p.numel() for _, p, _ in samples) + new
        # tensor parallel (sequence parallel) splits the sequence: keep the training length there
        width = cfg.sequence_len if cfg.tensor_parallel_size > 1 else min(cfg.sequence_len, _round16(need))
        log.info(
            "lowprec: eval_table_size = %d prompts, eval_max_new_tokens = %d (%s), %d-token window",
            len(samples),
            new,
            why,
            width,
        )
        return cls(samples, new, width, cfg.micro_batch_size, tokenizer, os.path.join(output_dir, TABLE_FILE), title)

    def generate(self, model: torch.nn.Module, step: int, device: torch.device, processes: int = 1) -> dict[str, Any]:
        """The ``generations`` record of this evaluation (run on every process)."""
        was_training = model.training
        model.eval()
        try:
            outs = greedy_generate(
                model,
                [p for _, p, _ in self.samples],
                self.max_new_tokens,
                self.width,
                self.rows,
                self.tokenizer.eos_id,
                self.tokenizer.pad_id,
                device,
                stop_early=processes == 1,
            )
        finally:
            model.train(was_training)
        decode = self.tokenizer.decode
        return {
            "kind": "generations",
            "step": step,
            "max_new_tokens": self.max_new_tokens,
            "samples": [
                {
                    "index": i,
                    "prompt": decode(p.tolist()),
                    "reference": decode(ref.tolist()),
                    "generated": decode(o),
                    "new_tokens": len(o),
                }
                for (i, p, ref), o in zip(self.samples, outs)
            ],
        }

    def write(self, record: dict[str, Any]) -> str:
        """Rewrite ``eval_generations.md`` with this evaluation's section added (atomically)."""
        self.records = [r for r in self.records if r["step"] < record["step"]] + [record]
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(render_markdown(self.records, self.title))
        os.replace(tmp, self.path)
        return self.path
