"""lowprec's FP8 exports as frozen FP8 bases: ``load_fp8_base`` keeps an export's E4M3 bytes and
scales (1 byte per weight resident), LoRA trains on them, ``merge_lora_fp8_base`` writes the base's
format back; a quantization_config lowprec cannot load is one line. (The exports themselves:
test_export.py; the direct load and the bf16 merge: test_export_fp8_base.py.)"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

import lowprec.fp8 as fp8
from lowprec.export import export_model
from tests.test_export import _base_layers, _llama, _load, _rel

pytest.importorskip("transformers", reason="needs transformers (dev extra)")


BASES = [  # recipe, format, the base layers' granularity, the scale's key
    ("blockwise", "hf-fp8", "block", "weight_scale_inv"),
    ("tensorwise", "compressed-tensors", "tensor", "weight_scale"),
    ("rowwise", "compressed-tensors", "channel", "weight_scale"),
    ("blockwise", "compressed-tensors", "block", "weight_scale"),
]


def _assert_holds_stored(layers: dict, stored: dict, scale_key: str) -> None:
    """Each Float8BaseLinear holds the file's E4M3 bytes and scales, bit for bit."""
    for n, m in layers.items():
        assert torch.equal(m.weight, stored[f"{n}.weight"].view(torch.uint8)), n
        scale = stored[f"{n}.{scale_key}"]
        assert torch.equal(m.stored_scale(), scale.reshape(m.stored_scale().shape)), n


def _fwd_bwd(m, ids):
    """Logits and the input gradient of one training-mode forward and backward."""
    m.train()
    emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = m(inputs_embeds=emb).logits.float()
    logits.square().mean().backward()
    return logits.detach(), emb.grad


def _lora_steps(model, ids, steps=4):
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe,fmt,granularity,scale_key", BASES, ids=[f"{c[1]}-{c[0]}" for c in BASES])
def test_fp8_exports_are_frozen_fp8_bases_for_lora_and_merge(tmp_path, recipe, fmt, granularity, scale_key):
    """load_fp8_base keeps the stored E4M3 bytes and scales (1 byte per weight resident) of an
    hf-fp8 or compressed-tensors (per tensor, channel, block) export, computes what transformers'
    dequantized model computes, runs the trained model's FP8 forward from the stored scales (bit
    for bit), peft LoRA trains on it without moving them, and merge_lora_fp8_base writes the base's
    format with the merged layers re-quantized: within one FP8 rounding of base + adapter."""
    import peft

    from lowprec.export import load_fp8_base
    from lowprec.export.fp8_merge import merge_lora_fp8_base

    model = _llama()
    fp8.convert(model, recipe)
    base_dir, merged_dir = tmp_path / "base", tmp_path / "merged"
    report = export_model(model, str(base_dir), fmt)
    base = load_fp8_base(str(base_dir))
    layers = _base_layers(base)
    assert sorted(layers) == sorted(report.quantized) and {m.granularity for m in layers.values()} == {granularity}
    params = sum(m.weight.numel() for m in layers.values())
    resident = sum(m.weight.nbytes + m.weight_scale_bits.nbytes for m in layers.values())
    assert all(m.weight.dtype == torch.uint8 for m in layers.values()) and resident / params <= 1.05
    stored = load_file(str(base_dir / "model.safetensors"))
    _assert_holds_stored(layers, stored, scale_key)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():  # the same weights as transformers' dequantized load of the directory
        with fp8.autocast(enabled=False):
            hp = base(ids).logits.float()
        assert _rel(hp, _load(str(base_dir), fmt)(ids).logits.float()) < 1e-2
    # FP8 GEMMs from the stored scales: the trained model's forward (the recipe's casts of x), bit
    # for bit; its input gradient too, but per channel (the row scales fold into dY there)
    with torch.no_grad():  # the export stores what is not FP8 in bf16: the same rounding on the trained model
        for m in model.modules():
            if not isinstance(m, fp8.Float8Linear):
                for p in m.parameters(recurse=False):
                    p.copy_(p.bfloat16())
    (want, want_grad), (got, got_grad) = _fwd_bwd(model, ids), _fwd_bwd(base, ids)
    assert torch.equal(got, want)
    assert _rel(got_grad, want_grad) < 1e-4 if granularity == "channel" else torch.equal(got_grad, want_grad)
    assert any("FP8 base weights" in why for _, why in fp8.convert(base, "blockwise").skipped)  # left as stored
    # LoRA on the FP8 base (q_proj of layer 0 stayed high precision): adapters train, the bytes do not move
    lora = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj", "up_proj"]))
    before = {n: m.weight.clone() for n, m in layers.items()}
    losses = _lora_steps(lora, ids)
    assert losses[-1] < losses[0]
    assert all(torch.equal(m.weight, before[n]) for n, m in layers.items())
    with torch.no_grad(), fp8.autocast(enabled=False):
        unmerged = lora(ids).logits.float()
        with lora.disable_adapter():
            base_only = lora(ids).logits.float()
    # the merge: the base's format, merged layers re-quantized with its rule, the others as stored
    merge = merge_lora_fp8_base(lora, str(merged_dir))
    targeted = sorted(n for n in layers if n.endswith(("q_proj", "v_proj", "up_proj")))
    assert merge.format == fmt and merge.merged == targeted and "not trained" in merge.how
    assert sorted(merge.merged + merge.unchanged) == sorted(layers)
    assert json.load(open(merged_dir / "lowprec_merge.json"))["merged"] == targeted
    qc, base_qc = (json.load(open(d / "config.json"))["quantization_config"] for d in (merged_dir, base_dir))
    assert (
        qc["config_groups" if fmt != "hf-fp8" else "weight_block_size"]
        == base_qc["config_groups" if fmt != "hf-fp8" else "weight_block_size"]
    )
    merged_stored = load_file(str(merged_dir / "model.safetensors"))
    for n in merge.unchanged:
        assert torch.equal(merged_stored[f"{n}.weight"].view(torch.uint8), stored[f"{n}.weight"].view(torch.uint8))
        assert torch.equal(merged_stored[f"{n}.{scale_key}"], stored[f"{n}.{scale_key}"])
    again = load_fp8_base(str(merged_dir))
    assert sorted(_base_layers(again)) == sorted(layers)
    _assert_holds_stored(_base_layers(again), merged_stored, scale_key)
    with torch.no_grad():
        got_merged = _load(str(merged_dir), fmt)(ids).logits.float()
    # one FP8 rounding of the merged layers: within the export's own gap (one rounding of every FP8
    # layer), and far closer to base + adapter than the base alone is (the delta is in)
    gap = _rel(got_merged, unmerged)
    assert gap <= report.logit_gap and gap < 0.05 * _rel(base_only, unmerged)


def _edit_quantization_config(path, edit) -> None:
    cfg = json.load(open(path / "config.json"))
    edit(cfg["quantization_config"])
    json.dump(cfg, open(path / "config.json", "w"))


def test_an_fp8_base_lowprec_cannot_load_is_one_line(tmp_path, monkeypatch):
    from lowprec.export import load_fp8_base

    model = _llama()
    fp8.convert(model, "nvfp4")
    export_model(model, str(tmp_path / "nvfp4"), "compressed-tensors")
    with pytest.raises(ValueError, match=r"group_0 \(preset NVFP4A16, format nvfp4-pack-quantized\) lowprec cannot"):
        load_fp8_base(str(tmp_path / "nvfp4"))
    model = _llama()
    fp8.convert(model, "tensorwise")
    ct = tmp_path / "ct"
    export_model(model, str(ct), "compressed-tensors")

    def static_acts(qc):  # compressed-tensors' FP8 preset: calibrated per-tensor activation scales
        qc["config_groups"]["group_0"]["input_activations"].update(strategy="tensor", dynamic=False)

    def int_weights(qc):
        qc["config_groups"]["group_0"]["weights"]["type"] = "int"

    def unreadable(qc):
        qc["config_groups"]["group_0"]["weights"]["strategy"] = "diagonal"

    cases = [
        (static_acts, r"group_0 \(preset FP8, format float-quantized\).*activations are not dynamic FP8"),
        (int_weights, "weights are not 8-bit float"),
        (unreadable, "quantization_config compressed-tensors cannot read"),
    ]
    for edit, needle in cases:
        case = tmp_path / edit.__name__
        case.mkdir()
        for name in ("config.json", "model.safetensors"):
            (case / name).write_bytes((ct / name).read_bytes())
        _edit_quantization_config(case, edit)
        with pytest.raises(ValueError, match=needle) as info:
            load_fp8_base(str(case))
        assert "\n" not in str(info.value) and "lowprec export --format compressed-tensors" in str(info.value)
    with pytest.raises(ValueError, match="no config.json"):
        load_fp8_base(str(tmp_path))
    monkeypatch.setitem(sys.modules, "compressed_tensors", None)
    with pytest.raises(
        ValueError, match=r"compressed-tensors checkpoint; reading it needs .*pip install 'lowprec\[export\]'"
    ):
        load_fp8_base(str(ct))
