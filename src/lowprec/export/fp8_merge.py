"""``merge_lora`` onto a frozen FP8 base: the LoRA delta merged into each FP8 layer's
dequantized base weight in float32, re-quantized once with the base's own format rule (its
granularity and block size: ``amax / 448`` per tensor, output channel or block, as
:func:`~lowprec.export.casts.format_cast`), written in the base's format (hf-fp8 ->
hf-fp8, compressed-tensors -> compressed-tensors with the base's groups, targets and ignore list),
so the merged directory loads again as an FP8 base and in transformers / vLLM. Or, with
``format="bf16"``, a plain bf16 transformers model: the merged weights from the same float32 sums,
every other FP8 layer dequantized (``q * scale``), one bf16 rounding and no FP8 at all.

The merged weights' scales are new (made from the merged weights), not trained ones: no forward
read them. FP8 layers no adapter touched keep their stored bytes and scales exactly; adapters on
high-precision layers (and ``modules_to_save``) merge as peft merges them.

The merge streams: one adapted layer at a time is dequantized to float32, merged and re-quantized
(fp8: it becomes a new frozen FP8 layer, 1 byte per weight) or rounded to bf16, and the float32
sum is dropped before the next; the files are then written by :mod:`lowprec.export.shards`,
which makes each tensor (a bf16 cast, an unchanged layer's dequantization in bf16, a
compressed-tensors compression) only for the file that holds it. So the merge holds the FP8 model,
one layer in float32 and one output file's new tensors: with ``max_shard_bytes`` that is one
shard; in one ``model.safetensors`` (the default) the new tensors of the whole file (bf16: the
bf16 model; fp8: the high-precision layers' bf16 copies, the FP8 bytes being the model's own). The
files are the ones the dense merge wrote (:mod:`lowprec.export.fp8_merge_dense`, ``stream=False``)
bit for bit.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import typing
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lowprec.export.casts import Scheme, format_cast
from lowprec.export.fp8_base import BASE_ATTR, BaseFormat, read_base_format
from lowprec.export.fp8_merge_dense import dense_layer, lora_delta, merge_dense
from lowprec.export.hf_config import hf_config_of
from lowprec.export.layers import LayerPlan, QuantizedLayer
from lowprec.export.shards import Entry, atomic_write, write_json, write_tensors
from lowprec.export.writers import _STORED, _compressed_tensors, _refuse_unheld, hf_fp8_quantization_config
from lowprec.fp8 import plain_state_dict, unconvert
from lowprec.fp8.cast.quantize import Float8Data
from lowprec.fp8.modules.conv1d import is_conv1d
from lowprec.fp8.modules.fp8_base import Float8BaseLinear

if TYPE_CHECKING:  # transformers: optional at run time
    from transformers import PreTrainedModel

__all__ = ["MergeReport", "merge_lora_fp8_base", "MERGE_FORMATS"]

MERGE_FORMATS = ("fp8", "bf16")  # what merge_lora writes from an FP8 base
E4M3 = torch.float8_e4m3fn

logger = logging.getLogger("lowprec")


@dataclass
class MergeReport:
    """What the merge wrote (also ``lowprec_merge.json`` in the directory)."""

    out_dir: str
    format: str
    base: str
    how: str
    merged: list[str] = field(default_factory=list)  # FP8 layers re-quantized after the merge
    unchanged: list[str] = field(default_factory=list)  # FP8 layers written with their stored bytes

    def __str__(self) -> str:
        return (
            f"lowprec: merge_lora onto the FP8 base {self.base}: {self.format} in {self.out_dir}; "
            f"{len(self.merged)} FP8 layer(s) merged and {self.how}; {len(self.unchanged)} kept their stored bytes"
        )


def merge_lora_fp8_base(
    peft_model: nn.Module,
    out: str,
    format: str = "fp8",
    *,
    max_shard_bytes: int | None = None,
    stream: bool = True,
) -> MergeReport:
    """Merge ``peft_model``'s LoRA adapters into its FP8 base (loaded by ``load_fp8_base``) and
    write the merged model to ``out``: ``format`` ``fp8`` (the default) in the base's FP8 format,
    the merged layers re-quantized once; ``bf16`` as a plain bf16 transformers model (every FP8
    layer dequantized, the merged ones from their float32 sum, one bf16 rounding, no FP8).
    ``max_shard_bytes``: shards of at most that many bytes and an index (default one file).
    ``stream=False``: the dense merge this one replaced (one file; peaks at the model's float32
    size). Changes the model in place (its adapters are unloaded): run it last."""
    if format not in MERGE_FORMATS:
        raise ValueError(
            f"merge_lora_fp8_base(format={format!r}): choose one of {', '.join(MERGE_FORMATS)} "
            "(fp8: the base's FP8 format, re-quantized; bf16: a plain bf16 model)"
        )
    if not stream and max_shard_bytes is not None:
        raise ValueError("merge_lora_fp8_base(stream=False) writes one file; drop max_shard_bytes or stream")
    peft: Any = peft_model  # a peft PeftModel: get_base_model / merge_and_unload are peft's
    inner = peft.get_base_model()
    fmt: BaseFormat = getattr(inner, BASE_ATTR, None) or read_base_format(str(inner.name_or_path))
    os.makedirs(out, exist_ok=True)
    if stream and format == "bf16" and _converts_keys_on_save(inner):
        logger.info(
            "lowprec: merge_lora_fp8_base: transformers converts %s's weight names on save; writing the bf16 "
            "merge through save_pretrained (the dense merge: peaks at the model's float32 size)",
            type(inner).__name__,
        )
        stream = False
    if not stream:
        merged, unchanged = merge_dense(peft_model, fmt, out, format)
    elif format == "bf16":
        merged, unchanged = _stream_bf16(peft_model, inner, out, max_shard_bytes)
    else:
        merged, unchanged = _stream_fp8(peft_model, inner, fmt, out, max_shard_bytes)
    if format == "bf16":
        how = (
            "the LoRA delta merged into the dequantized base weight in float32, written in bf16 (one bf16 "
            f"rounding; the base was {fmt.describe}); the unchanged FP8 layers written dequantized (q * scale) in bf16"
        )
        written = "bf16"
    else:
        how = (
            "the LoRA delta merged into the dequantized base weight in float32, then re-quantized once with the "
            f"base's format rule ({fmt.describe}): new scales, not trained ones"
        )
        written = fmt.format
    report = MergeReport(os.path.abspath(out), written, fmt.path, how, merged, unchanged)
    write_json(os.path.join(report.out_dir, "lowprec_merge.json"), asdict(report), indent=1)
    logger.info("%s", report)
    return report


@torch.no_grad()  # the adapters' weights require grad: no graph may keep a layer's float32 sum alive
def _merge_layers(inner: nn.Module, make: Any) -> list[str]:
    """Replace each LoRA layer on an FP8 base layer by ``make(base, merged float32 weight)``, one
    layer at a time (the float32 sum is dropped before the next); the names, sorted."""
    # peft: optional; a model with adapters has it
    from peft.tuners.lora import LoraLayer

    names = [
        n
        for n, m in inner.named_modules()
        if isinstance(m, LoraLayer) and isinstance(m.get_base_layer(), Float8BaseLinear)
    ]
    for name in names:
        lora = typing.cast(LoraLayer, inner.get_submodule(name))  # names: LoRA layers on FP8 base layers
        base = typing.cast(Float8BaseLinear, lora.get_base_layer())
        w = base.fp8_weight().dequantize(torch.float32)
        w += lora_delta(lora).to(w.device)
        inner.set_submodule(name, make(base, w))  # the adapter is merged: peft's merge skips it
        del w, lora, base
    return sorted(names)


def _requantized(base: Float8BaseLinear, w: torch.Tensor) -> Float8BaseLinear:
    """The merged weight re-quantized, written over the base layer's own bytes and scales (the
    same shapes): the merge allocates nothing that outlives the layer's float32 temporaries."""
    cast = format_cast(w, Scheme(base.granularity, base.block))
    q, s = base.weight.view(E4M3), base.stored_scale()
    q.copy_(cast.data)
    s.copy_(torch.reciprocal(cast.scale).reshape(s.shape))
    del cast
    return Float8BaseLinear(
        q,
        s,
        base.bias,
        base.block,
        granularity=base.granularity,
        transposed=base.transposed,
    )


def _rest(model: nn.Module, skip: set[str]) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors but ``skip`` (no FP8 scaling state), a tied weight once under its first
    key (the embedding), as ``writers.bf16_state`` keeps them; not yet cast."""
    seen: set[int] = set()
    out = []
    for k, t in plain_state_dict(model.state_dict(keep_vars=True)).items():
        if k in skip:
            continue
        if t.data_ptr() in seen and t.numel() > 0:
            continue
        seen.add(t.data_ptr())
        out.append((k, t))
    return out


def _bf16_entry(key: str, t: torch.Tensor) -> Entry:
    """A tensor as the file holds it: floats in bf16, the rest as they are."""
    size = t.numel() * (2 if t.is_floating_point() else t.element_size())

    def make() -> torch.Tensor:
        t2 = t.detach().to("cpu")
        return t2.to(torch.bfloat16) if t2.is_floating_point() else t2

    return Entry(key, size, make)


def _fp8_layers(model: nn.Module) -> dict[str, Float8BaseLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Float8BaseLinear)}


def _plan(model: nn.Module, layers: dict[str, Float8BaseLinear]) -> LayerPlan:
    """The writers' plan: each FP8 layer with its stored bytes and scales, the other Linear layers kept."""
    plan = LayerPlan(how="re-quantized once with the base's format rule after the merge (not trained scales)")
    for name, m in layers.items():
        plan.quantized.append(QuantizedLayer(name, m.fp8_weight(), m.transposed, False, m.stored_scale()))
    for name, m in model.named_modules():
        if (isinstance(m, nn.Linear) or is_conv1d(m)) and name not in layers:
            plan.kept[name] = "high precision in the FP8 base"
    return plan


def _stream_fp8(
    peft_model: Any, inner: nn.Module, fmt: BaseFormat, out: str, max_shard_bytes: int | None
) -> tuple[list[str], list[str]]:
    merged = _merge_layers(inner, _requantized)
    plain = peft_model.merge_and_unload()  # adapters on high-precision layers, modules_to_save
    layers = _fp8_layers(plain)
    plan = _plan(plain, layers)
    skip = {f"{n}.{p}" for n in layers for p in ("weight", "weight_scale_bits")}
    entries = [_bf16_entry(k, t) for k, t in _rest(plain, skip)]
    config = hf_config_of(plain)
    if fmt.format == "hf-fp8":
        entries += [e for name, m in layers.items() for e in _hf_fp8_entries(name, m)]
        write_tensors(entries, out, max_shard_bytes)
        write_json(os.path.join(out, "config.json"), hf_fp8_quantization_config(config, plan), indent=1, sort_keys=True)
    else:
        _write_ct(plain, plan, layers, set(merged), entries, config, fmt, out, max_shard_bytes)
    return merged, sorted(set(layers) - set(merged))


def _hf_fp8_entries(name: str, m: Float8BaseLinear) -> list[Entry]:
    """The stored bytes and scales (Conv1D: transposed back to (in, out), as stored)."""

    def q() -> torch.Tensor:
        w = m.weight.view(E4M3)
        return w.t().contiguous() if m.transposed else w

    def s() -> torch.Tensor:
        s = m.stored_scale()
        return s.t().contiguous() if m.transposed else s

    return [
        Entry(f"{name}.weight", m.weight.numel(), q),
        Entry(f"{name}.weight_scale_inv", 4 * m.stored_scale().numel(), s),
    ]


def _meta_copy(model: nn.Module, layers: dict[str, Float8BaseLinear]) -> nn.Module:
    """The model's module tree with every parameter and buffer on the meta device (no storage), its
    FP8 layers as plain ``nn.Linear``: what compressed-tensors reads the config's groups from."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=False) if isinstance(t, nn.Parameter) else meta
    skeleton = copy.deepcopy(model, memo)
    for name, m in layers.items():
        skeleton.set_submodule(name, nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta"))
    unconvert(skeleton)
    return skeleton


def _write_ct(
    plain: nn.Module,
    plan: LayerPlan,
    layers: dict[str, Float8BaseLinear],
    merged: set[str],
    entries: list[Entry],
    config: dict[str, Any],
    fmt: BaseFormat,
    out: str,
    max_shard_bytes: int | None,
) -> None:
    """compressed-tensors: the base's config applied to a meta copy of the model (its groups and
    ignore list, as ``write_compressed_tensors``); a merged layer compressed by the package's own
    compressor when its file is written, an unchanged one written with its stored bytes and scales."""
    ct = _compressed_tensors()
    # compressed-tensors: the writer's optional dependency, imported through _compressed_tensors above
    from compressed_tensors.compressors.base import compress_module
    from compressed_tensors.quantization import QuantizationStatus

    first = typing.cast(Float8Data, plan.quantized[0].cast)  # FP8 base layers' casts (fp8_weight)
    _refuse_unheld(plan, Scheme({"axis": "channel"}.get(first.granularity, first.granularity), fmt.block))
    base = fmt.ct.config if fmt.ct else None
    if base is None:
        raise ValueError(f"FP8 base {fmt.path}: compressed-tensors without its config; load it with load_fp8_base")
    kind = ct.CompressionFormat.float_quantized.value
    groups = {k: v.model_copy(deep=True) for k, v in base.config_groups.items()}
    qconfig = ct.QConfig(config_groups=groups, ignore=list(base.ignore or []), format=base.format)
    skeleton = _meta_copy(plain, layers)
    ct.apply_config(skeleton, qconfig)
    compressor = ct.ModelCompressor.from_pretrained_model(skeleton, quantization_format=kind)
    if compressor.quantization_config is not None:
        compressor.quantization_config.quantization_status = QuantizationStatus.COMPRESSED  # as compress_model
    by_name = {q.name: q for q in plan.quantized}
    for name, m in layers.items():
        shell = skeleton.get_submodule(name)
        compress_module(shell, kind)  # on meta: the names, dtypes and shapes the compressor writes
        stored = {k: t for k, t in shell.state_dict().items() if t.dtype == E4M3 or k.endswith(_STORED)}
        if name not in merged:  # the stored bytes and scales, in the shapes the compressor writes
            shape = tuple(stored["weight_scale"].shape)
            entries.append(Entry(f"{name}.weight", m.weight.numel(), functools.partial(_stored_weight, m)))
            scale = Entry(
                f"{name}.weight_scale",
                4 * m.stored_scale().numel(),
                functools.partial(_stored_scale, m, shape),
            )
            entries.append(scale)
            continue
        cache: dict[str, torch.Tensor] = {}

        def make(
            key: str, name: str = name, shell: nn.Module = shell, cache: dict = cache, stored: dict = stored
        ) -> torch.Tensor:
            if not cache:  # the layer compressed once, when its first tensor is written
                got = _compress_by_rows(layers[name], shell, by_name[name], kind)
                got = got if got is not None else _compressed(shell, by_name[name], kind)
                cache.update({k: got[k].reshape(stored[k].shape) for k in stored})
            return cache.pop(key)

        entries += [
            Entry(f"{name}.{k}", t.numel() * t.element_size(), functools.partial(make, k)) for k, t in stored.items()
        ]
    write_tensors(entries, out, max_shard_bytes)

    def config_json(tmp: str) -> None:  # the package's update_config rewrites config.json in a directory
        d = tmp + ".d"
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f, indent=1, sort_keys=True)
        compressor.update_config(d)
        os.replace(os.path.join(d, "config.json"), tmp)
        os.rmdir(d)

    atomic_write(os.path.join(out, "config.json"), config_json)


def _stored_weight(m: Float8BaseLinear) -> torch.Tensor:
    return m.weight.view(E4M3)


def _stored_scale(m: Float8BaseLinear, shape: tuple[int, ...]) -> torch.Tensor:
    return m.stored_scale().reshape(shape)


def _compressed(shell: nn.Module, layer: QuantizedLayer, kind: str, rows: slice | None = None) -> dict:
    """compressed-tensors' own compression of ``layer`` (its dequantized weight and stored scales,
    as ``write_compressed_tensors`` hands them over), or of its output rows ``rows`` only."""
    # compressed-tensors: the writer's optional dependency (checked by _compressed_tensors)
    from compressed_tensors.compressors.base import compress_module
    from compressed_tensors.quantization.lifecycle.initialize import initialize_module_for_quantization

    weight = layer.cast.dequantize(torch.float32)
    scale = layer.format_scale()
    if rows is not None:
        weight = weight[rows]
        scale = _scale_rows(scale, rows, layer.cast)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    initialize_module_for_quantization(linear, shell.quantization_scheme)
    weight_scale = typing.cast(torch.Tensor, linear.weight_scale)  # the Parameter initialize_... registered
    weight_scale.data = scale.reshape(weight_scale.shape).to(weight_scale.dtype)
    compress_module(linear, kind)
    return {k: t.detach() for k, t in linear.state_dict().items()}


def _scale_rows(scale: torch.Tensor, rows: slice, cast: Any) -> torch.Tensor:
    """The stored scales of output rows ``rows``: per tensor all, per channel those rows, per
    block the rows of blocks (``rows`` on block boundaries)."""
    if scale.numel() == 1:
        return scale
    if cast.block is None:  # per channel: (out, 1)
        return scale.reshape(-1, 1)[rows]
    b = cast.block[0]
    return scale[rows.start // b : -(-rows.stop // b)]


def _compress_by_rows(m: Float8BaseLinear, shell: nn.Module, layer: QuantizedLayer, kind: str) -> dict | None:
    """compressed-tensors' compression of the layer (its dequantized weight and stored scales),
    run a block of output rows at a time (the compression is elementwise given the scales), so
    its temporaries are a row block's, not the layer's. Where it gives back the layer's own bytes
    and scales (the merge re-quantized them in place; the compressor's division rounds a few
    values to a neighbour), those are returned as views, else the blocks concatenated; None when
    it writes other tensors than ``weight`` and ``weight_scale`` (then compress the layer whole)."""
    out = m.out_features
    block = typing.cast(Float8Data, layer.cast).block  # an FP8 base layer's cast (fp8_weight)
    b = block[0] if block else None  # row blocks: whole scale blocks each
    step = 256 if b is None else max(b, 256 // b * b)
    q, scale = m.weight.view(E4M3), m.stored_scale()
    blocks: dict[str, list[torch.Tensor]] = {"weight": [], "weight_scale": []}
    own = {"weight": True, "weight_scale": True}
    for r0 in range(0, out, step):
        rows = slice(r0, min(out, r0 + step))
        got = _compressed(shell, layer, kind, rows)
        if set(got) != set(blocks) or got["weight_scale"].dtype != torch.float32:
            return None
        mine = {"weight": q[rows], "weight_scale": _scale_rows(scale, rows, layer.cast)}
        for k in blocks:
            same = torch.equal(got[k].reshape(-1).view(torch.uint8), mine[k].reshape(-1).view(torch.uint8))
            own[k] = own[k] and same
            blocks[k].append(got[k])
    result = {"weight": q if own["weight"] else torch.cat(blocks["weight"])}
    if scale.numel() == 1:  # per tensor: every block holds the one scale
        result["weight_scale"] = scale if own["weight_scale"] else blocks["weight_scale"][0]
    else:
        result["weight_scale"] = scale if own["weight_scale"] else torch.cat(blocks["weight_scale"])
    return result


def _stream_bf16(
    peft_model: Any, inner: nn.Module, out: str, max_shard_bytes: int | None
) -> tuple[list[str], list[str]]:
    """``format="bf16"``: each merged layer's weight made (dequantized + delta in float32, rounded
    to bf16) and each unchanged FP8 layer dequantized to bf16 only as its file is written (the
    model holds a meta placeholder meanwhile, the LoRA layer is kept aside); transformers' keys
    (its tied and ignored keys dropped, as ``save_pretrained``); config and generation config as
    it writes them."""
    # peft: optional; a model with adapters has it
    from peft.tuners.lora import LoraLayer

    lazy: dict[str, Any] = {}  # merged layer name -> its LoRA layer (base + adapters)
    for name, m in list(inner.named_modules()):
        if isinstance(m, LoraLayer) and isinstance(base := m.get_base_layer(), Float8BaseLinear):
            placeholder = torch.empty(base.out_features, base.in_features, dtype=torch.bfloat16, device="meta")
            inner.set_submodule(name, dense_layer(base, placeholder, own_layout=True))  # peft's merge skips it
            lazy[name] = m
    plain = peft_model.merge_and_unload()  # adapters on high-precision layers, modules_to_save
    layers = _fp8_layers(plain)
    if getattr(plain.config, "quantization_config", None) is not None:
        del plain.config.quantization_config
    if hasattr(plain, BASE_ATTR):
        delattr(plain, BASE_ATTR)  # no longer an FP8 model
    keys = _saved_keys(plain)
    entries = []
    for k, t in plain.state_dict(keep_vars=True).items():
        name = k.removesuffix(".weight")
        if k not in keys or k.endswith(".weight_scale_bits") and k[: -len(".weight_scale_bits")] in layers:
            continue
        if name in lazy:
            entries.append(Entry(k, 2 * t.numel(), functools.partial(_merged_bf16, lazy[name])))
        elif name in layers and k.endswith(".weight"):
            entries.append(Entry(k, 2 * t.numel(), functools.partial(_dequantized_bf16, layers[name])))
        else:
            entries.append(_bf16_entry(k, t))
    write_tensors(entries, out, max_shard_bytes)
    plain.config.dtype = "bfloat16"
    plain.config.architectures = [type(plain).__name__]
    plain.config.save_pretrained(out)
    if plain.can_generate():
        plain.generation_config.save_pretrained(out)
    return sorted(lazy), sorted(set(layers))


@torch.no_grad()
def _merged_bf16(lora: Any) -> torch.Tensor:
    """A LoRA layer on an FP8 base layer merged: (dequantized + delta) in float32, rounded to bf16,
    in the base's stored layout (Conv1D: (in, out))."""
    base = lora.get_base_layer()
    w = base.fp8_weight().dequantize(torch.float32)
    w += lora_delta(lora).to(w.device)
    w = w.to(torch.bfloat16)
    return w.t().contiguous() if base.transposed else w


def _dequantized_bf16(m: Float8BaseLinear) -> torch.Tensor:
    w = m.fp8_weight().dequantize(torch.float32).to(torch.bfloat16)
    return w.t().contiguous() if m.transposed else w


def _converts_keys_on_save(model: PreTrainedModel) -> bool:
    """Whether ``save_pretrained`` would rename or convert the model's weights (transformers'
    conversion mapping of the class, or the one its load attached), as ``revert_weight_conversion``
    decides it."""
    # transformers: the FP8 base is a transformers model
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [
            c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)
        ]
    return bool(conversions)


def _saved_keys(model: PreTrainedModel) -> set[str]:
    """The keys ``save_pretrained`` writes: the state dict without transformers' tied and ignored
    keys. A model whose keys transformers renames on save is refused (the dense merge writes it)."""
    # transformers: the FP8 base is a transformers model
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    sd = model.state_dict()
    for k in getattr(model, "_keys_to_ignore_on_save", None) or []:
        sd.pop(k, None)
    sd = remove_tied_weights_from_state_dict(sd, model)
    meta = {k: torch.empty_like(t, device="meta") for k, t in sd.items()}
    if set(revert_weight_conversion(model, meta)) != set(sd):
        raise ValueError(
            f"merge_lora_fp8_base: transformers renames {type(model).__name__}'s weights on save; "
            "merge with stream=False (the dense merge, through save_pretrained)"
        )
    return set(sd)
