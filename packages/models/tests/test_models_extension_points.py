"""The decoder's public extension points (README, "Extension points"): a subclass that overrides
``moe``, ``scatter_sequence``, ``gather_sequence`` and ``gather_layer_tokens`` is called where
the README says, and what its override returns is what the decoder uses."""

from __future__ import annotations

from collections import Counter
from typing import TypeVar

import torch
from torch import Tensor

from posttrain.models import (
    DecoderModel,
    LoraRouting,
    MlaLayer,
    ModelConfig,
    MoeLayer,
    build_model,
)

LENGTHS = [5, 7]
M = TypeVar("M", bound=DecoderModel)


class Recording(DecoderModel):
    """Each seam delegates to the decoder's own and counts its calls."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.calls: Counter[str] = Counter()

    def scatter_sequence(self, h: Tensor) -> Tensor:
        self.calls["scatter_sequence"] += 1
        return super().scatter_sequence(h)

    def gather_sequence(self, h: Tensor) -> Tensor:
        self.calls["gather_sequence"] += 1
        return super().gather_sequence(h)

    def gather_layer_tokens(self, x: Tensor) -> Tensor:
        self.calls["gather_layer_tokens"] += 1
        return super().gather_layer_tokens(x)

    def moe(self, layer: MoeLayer | MlaLayer, m: Tensor, lora: LoraRouting, prefix: str) -> Tensor:
        assert prefix == f"model.layers.{layer.index}."
        self.calls["moe"] += 1
        return super().moe(layer, m, lora, prefix)


class NoExperts(DecoderModel):
    """A MoE seam that returns zeros: the layers then add nothing for their experts."""

    def moe(self, layer: MoeLayer | MlaLayer, m: Tensor, lora: LoraRouting, prefix: str) -> Tensor:
        return torch.zeros_like(m)


def _same_weights(cls: type[M], base: DecoderModel) -> M:
    model = cls(base.config)
    model.load_state_dict(base.state_dict())
    return model


def _ids(config: ModelConfig) -> Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(4, config.vocab_size, (sum(LENGTHS),), generator=gen)


def test_each_seam_is_called_and_the_overrides_keep_the_bits() -> None:
    config = ModelConfig.tiny()
    base = build_model(config, seed=1)
    model = _same_weights(Recording, base)
    ids = _ids(config)
    got = model.forward_logprobs(ids, LENGTHS)
    assert torch.equal(got, base.forward_logprobs(ids, LENGTHS))
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    assert moe_layers == 3
    assert model.calls == {"scatter_sequence": 1, "gather_sequence": 1, "moe": moe_layers}
    model.calls.clear()
    cache = model.new_kv_cache(1)
    model.prefill(cache, 0, ids[:4].tolist())  # decode runs the layers through them too
    assert model.calls == {"scatter_sequence": 1, "gather_sequence": 1, "moe": moe_layers}


def test_the_mla_rope_key_goes_through_gather_layer_tokens() -> None:
    config = ModelConfig.mla_tiny()
    base = build_model(config, seed=2)
    model = _same_weights(Recording, base)
    ids = _ids(config)
    assert torch.equal(model.forward_logprobs(ids, LENGTHS), base.forward_logprobs(ids, LENGTHS))
    layers = config.num_hidden_layers
    assert model.calls["gather_layer_tokens"] == layers  # once per layer, packed forward
    assert model.calls["moe"] == layers - 1  # layer 0 is dense


def test_what_moe_returns_is_what_the_layer_adds() -> None:
    config = ModelConfig.tiny()
    base = build_model(config, seed=3)
    ids = _ids(config)
    without = _same_weights(NoExperts, base).forward_logprobs(ids, LENGTHS)
    assert not torch.equal(without, base.forward_logprobs(ids, LENGTHS))
    with torch.no_grad():  # zero expert outputs: every routed expert's down projection is 0
        for layer in base.layers:
            if isinstance(layer, MoeLayer):
                layer.experts_fc2.zero_()
    assert torch.equal(without, base.forward_logprobs(ids, LENGTHS))
