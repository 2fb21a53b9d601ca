"""Write a tiny Hugging Face Llama and its tokenizer to a directory, as
``save_pretrained`` does for a real one, so the LoRA / fine-tuning examples run offline:

    python examples/make_tiny_llama.py outputs/tiny-llama
    lowprec train examples/alpaca_lora.yaml          # base_model: outputs/tiny-llama

The model is briefly pre-trained (``--pretrain_steps``, plain PyTorch, a few seconds on CPU) on
examples/data/notes.jsonl, so that, like a real base model, it already knows its bytes and a
fine-tune (LoRA above all, which cannot move a random output head far) has something to build
on. The tokenizer is byte-level BPE with no merges (every UTF-8 byte is a token, as in GPT-2's
alphabet) plus <s>, </s>, <pad> and ChatML's <|im_start|> / <|im_end|>, with a ChatML chat
template; nothing is trained or downloaded. Every Linear is a multiple of 16 wide (FP8 GEMMs
need it). ``--arch gpt2`` writes a GPT-2 instead (its projections are transformers ``Conv1D``).
"""

from __future__ import annotations

import argparse
import os

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer():
    """A PreTrainedTokenizerFast over the 256 byte symbols plus SPECIALS (261 ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {s: i for i, s in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", chat_template=CHATML
    )


def make_model(tokenizer, arch: str = "llama", hidden: int = 64, layers: int = 2, seed: int = 0):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    vocab = -(-len(tokenizer) // 16) * 16  # 261 -> 272: the LM head is a GEMM too
    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    if arch == "gpt2":
        cfg = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=512, **ids)
        return GPT2LMHeadModel(cfg)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        **ids,
    )
    return LlamaForCausalLM(cfg)


def pretrain(
    model, tokenizer, steps: int, seq: int = 64, batch: int = 8, lr: float = 3e-3, seed: int = 0
) -> list[float]:
    """Causal-LM training on random windows of the bundled notes (AdamW, fixed seed)."""
    import json

    import torch

    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "data", "notes.jsonl")) as f:
        text = "\n".join(json.loads(line)["text"] for line in f)
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq, (batch,), generator=g)
        x = torch.stack([ids[s : s + seq] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    return losses


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--arch", choices=("llama", "gpt2"), default="llama")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (a multiple of 16)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--pretrain_steps", type=int, default=100, help="steps of pre-training on the notes (0: random)")
    args = ap.parse_args(argv)
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, args.arch, args.hidden, args.layers)
    if args.pretrain_steps:
        losses = pretrain(model, tokenizer, args.pretrain_steps)
        print(f"pre-trained {args.pretrain_steps} steps: loss {losses[0]:.2f} -> {sum(losses[-10:]) / 10:.2f}")
    os.makedirs(args.out_dir, exist_ok=True)
    model.save_pretrained(args.out_dir)
    tokenizer.save_pretrained(args.out_dir)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote a tiny {args.arch} ({n / 1e3:.0f} k parameters) and its tokenizer to {args.out_dir}")
    return args.out_dir


if __name__ == "__main__":
    main()
