"""Every code snippet of Accelerate's low-precision training guide runs with
``accelerate`` replaced by ``lowprec``, and the Accelerate-named FP8 helpers work."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import lowprec.fp8 as fp8
from lowprec.kwargs import recipe_kwargs_from_config

SNIPPETS = [
    # 000: the v0.33 guide (note the docs' own spellings: kwarg_handlers, optimization_level)
    ("none", 'accelerator = Accelerator(mixed_precision="fp8")'),
    (
        "msamp",
        'kwargs = [FP8RecipeKwargs(backend="msamp")]\n'
        'accelerator = Accelerator(mixed_precision="fp8", kwarg_handlers=kwargs)',
    ),
    (
        "te",
        'kwargs = [FP8RecipeKwargs(backend="te")]\n'
        'accelerator = Accelerator(mixed_precision="fp8", kwarg_handlers=kwargs)',
    ),
    (
        "msamp",
        'kwargs = [FP8RecipeKwargs(backend="msamp", optimization_level="O2")]\n'
        'accelerator = Accelerator(mixed_precision="fp8", kwarg_handlers=kwargs)',
    ),
    # 002: the newer guide
    (
        "msamp",
        'kwargs = [MSAMPRecipeKwargs()]\naccelerator = Accelerator(mixed_precision="fp8", kwarg_handlers=kwargs)',
    ),
    ("te", 'kwargs = [TERecipeKwargs()]\naccelerator = Accelerator(mixed_precision="fp8", kwarg_handlers=kwargs)'),
    ("torchao", 'kwargs = [AORecipeKwargs()]\naccelerator = Accelerator(mixed_precision="fp8", kwarg_handlers=kwargs)'),
]


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_FP8_BACKEND", "LOWPREC_FP8_RECIPE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("backend, code", SNIPPETS)
def test_seed_snippet_trains(backend, code):
    scope: dict = {}
    header = (
        "from lowprec import Accelerator\n"
        "from lowprec.utils import FP8RecipeKwargs, TERecipeKwargs, MSAMPRecipeKwargs, AORecipeKwargs\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        exec(header + code, scope)
    acc = scope["accelerator"]
    assert acc.fp8_enabled
    expected = {"none": "native", "msamp": "msamp", "te": "te", "torchao": "torchao"}[backend]
    assert acc.backend.name == expected
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    w = model[2].weight.detach().clone()
    acc.backward(model(torch.randn(8, 32)).square().mean())
    opt.step()
    assert not torch.equal(w, model[2].weight)


@pytest.mark.parametrize(
    "cfg, cls, field, value",
    [
        (
            {
                "amax_compute_algo": "max",
                "amax_history_len": 1024,
                "backend": "TE",
                "fp8_format": "HYBRID",
                "interval": 1,
                "margin": 0,
                "override_linear_precision": "(false, false, false)",
                "use_autocast_during_eval": False,
            },
            "TERecipeKwargs",
            "amax_compute_algo",
            "max",
        ),
        ({"backend": "MSAMP", "opt_level": "O2"}, "MSAMPRecipeKwargs", "opt_level", "O2"),
    ],
)
def test_seed_yaml_fp8_config(cfg, cls, field, value):
    handler = recipe_kwargs_from_config(cfg)
    assert type(handler).__name__ == cls and getattr(handler, field) == value


def test_accelerate_named_helpers():
    from lowprec.utils import apply_fp8_autowrap, contextual_fp8_autocast, convert_model, has_transformer_engine_layers

    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 10), nn.Linear(10, 32), nn.Linear(32, 32))
    assert not has_transformer_engine_layers(model)
    convert_model(model)
    # TE's rule without the early return (bug 7): the layer after the skipped ones converts
    assert [isinstance(m, fp8.Float8Linear) for m in model] == [True, False, False, True]
    assert has_transformer_engine_layers(model)
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(fp8.fp8_enabled()))
    apply_fp8_autowrap(model)
    model(torch.randn(2, 32))
    model.eval()
    model(torch.randn(2, 32))
    assert seen == [True, False]
    assert model.forward.__func__.__wrapped__ is not None
    fwd = contextual_fp8_autocast(lambda x: fp8.fp8_enabled(), use_during_eval=True)
    assert fwd(model, None) is True
    convert_model(model, to_transformer_engine=False)
    assert not has_transformer_engine_layers(model)
