"""The cache API the engine's state layers are given (`vattn.engine.states`), for both designs of
transformers' mixers: 5.24's (`cache=`, `get_conv_state`) and 5.17-5.23's (`cache_params=`,
`has_previous_state`, `layers[i].conv_states[j]`), so the GPU image's transformers 5.17 runs
state models with their states (tests/engine/test_model_support.py runs them end to end on
whichever transformers is installed)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import build_model, tiny_config
from vattn.engine import states
from vattn.errors import UnsupportedModelError


class _Views:
    """A StateViews stand-in: one conv and one recurrent state of layer 0 for 2 slots."""

    def __init__(self) -> None:
        self.t = {("conv", 0, 0): torch.zeros(2, 3, 4), ("recurrent", 0, 0): torch.zeros(2, 5)}

    def view(self, kind: str, layer: int, index: int, slot: int) -> torch.Tensor:
        return self.t[(kind, layer, index)][slot:slot + 1]


class _OldMixer(torch.nn.Module):  # transformers 5.17's signature
    layer_idx = 0

    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        return cache_params, kwargs


class _NewMixer(torch.nn.Module):  # transformers 5.24's
    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        return cache, kwargs


def test_the_cache_goes_by_the_name_the_mixer_takes() -> None:
    assert states.cache_argument(_OldMixer()) == "cache_params"
    assert states.cache_argument(_NewMixer()) == "cache"
    c = states._SlotCache(_Views(), 1, fresh=False)
    got, rest = states._call_with_cache(_OldMixer().forward, "cache_params", torch.zeros(1, 1, 3), cache=c)
    assert got is c and "cache" not in rest  # given as cache=, a 5.17 mixer ran without its state


def test_the_older_cache_api_reads_and_writes_the_slot_views() -> None:
    views = _Views()
    fresh, old = states._SlotCache(views, 1, fresh=True), states._SlotCache(views, 1, fresh=False)
    assert not fresh.has_previous_state(0) and old.has_previous_state(0)
    layer = old.layers[0]
    assert layer.record_past is False
    layer.conv_states[0].fill_(7)  # causal_conv1d_update writes the conv state in place
    layer.recurrent_states[0].fill_(3)
    assert torch.all(views.t[("conv", 0, 0)][1] == 7) and torch.all(views.t[("conv", 0, 0)][0] == 0)
    assert torch.all(views.t[("recurrent", 0, 0)][1] == 3)


def test_a_model_whose_cache_keeps_no_state_is_refused() -> None:
    """No state found after the probe forward (as Mamba2 on 5.17 before its cache went by
    cache_params): refused, never run without its states."""
    with pytest.raises(UnsupportedModelError, match="no recurrent state"):
        states.state_specs(build_model(tiny_config()))
