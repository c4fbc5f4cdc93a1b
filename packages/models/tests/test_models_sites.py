"""Linear sites: each fused linear as a module, and the LoRA parity they give a wrapper."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posttrain.formats import lora_delta
from posttrain.models import LinearSite, LoraAdapter, ModelConfig, Numerics, build_model


class _Adapted(nn.Module):
    """What a trainer's LoRA layer does: base site plus the shared op on the site's kernel."""

    def __init__(self, base: LinearSite, a: Tensor, b: Tensor, scaling: float) -> None:
        super().__init__()
        self.base, self.a, self.b, self.scaling = base, a, b, scaling

    def forward(self, x: Tensor) -> Tensor:
        delta = lora_delta(x, self.a, self.b, self.scaling, linear=self.base.linear_kernel)
        return self.base(x) + delta


def test_every_fused_linear_is_a_site_with_its_peft_parts() -> None:
    tied = build_model(ModelConfig.tiny(tie_word_embeddings=True), seed=0)
    assert tied.linear_sites()["sites.lm_head"].weight is tied.embedding  # the head is tied
    cfg = ModelConfig.tiny()
    model = build_model(cfg, seed=0)
    sites = model.linear_sites()
    assert set(sites) == {
        "sites.lm_head",
        *(f"layers.0.sites.{p}" for p in ("qkv", "proj", "fc1", "fc2")),
        *(f"layers.{i}.sites.{p}" for i in (1, 2, 3) for p in ("qkv", "proj", "router")),
    }
    assert sites["sites.lm_head"].weight is model.output
    qkv = sites["layers.1.sites.qkv"]
    assert qkv.weight is model.layers[1].qkv
    assert [n for n, _ in qkv.parts] == [
        f"model.layers.1.self_attn.{m}_proj" for m in ("q", "k", "v")
    ]
    targets = model.lora_targets()
    for site in sites.values():
        assert sum(rows for _, rows in site.parts) == site.out_features
        for name, rows in site.parts:
            assert targets[name] == (site.in_features, rows)
    # sites own no parameter: names, conversion and state dicts are what they were
    assert all(
        ".sites." not in n and not n.startswith("sites.") for n, _ in model.named_parameters()
    )
    assert set(model.hf_state_dict()) == set(build_model(cfg, seed=0).hf_state_dict())


def test_site_kernel_follows_the_numerics() -> None:
    for numerics in Numerics:
        model = build_model(ModelConfig.tiny(), seed=0, numerics=numerics)
        site = model.linear_sites()["layers.0.sites.fc2"]
        assert site.linear_kernel == model.ops.linear
        x = torch.randn(3, site.in_features)
        assert torch.equal(site(x), model.ops.linear(x, model.layers[0].fc2))


def test_a_wrapped_site_matches_the_per_request_adapter_bit_for_bit() -> None:
    """The trainer-side wrapper and the engine's adapter hook compute the same bits (strict)."""
    cfg = ModelConfig.tiny()
    engine, trainer = build_model(cfg, seed=1), build_model(cfg, seed=1)
    gen = torch.Generator().manual_seed(0)
    weights: dict[str, tuple[Tensor, Tensor]] = {}
    for path, site in trainer.linear_sites().items():
        if path.endswith(("qkv", "fc1", "lm_head")):
            a = torch.randn(4, site.in_features, generator=gen) * 0.3
            b = torch.randn(site.out_features, 4, generator=gen) * 0.3
            rows = torch.split(b, [r for _, r in site.parts])
            weights.update(
                {n: (a.clone(), r.clone()) for (n, _), r in zip(site.parts, rows, strict=True)}
            )
            owner, leaf = path.rsplit(".", 1)
            trainer.get_submodule(owner)[leaf] = _Adapted(site, a, b, 2.0)
    assert set(trainer.linear_sites()) == set(engine.linear_sites())  # seen through wrappers
    adapter = LoraAdapter(weights=weights, scaling=2.0)
    ids = torch.randint(4, cfg.vocab_size, (30,), generator=gen)
    lp_trainer = trainer.forward_logprobs(ids, [12, 18])
    lp_engine = engine.forward_logprobs(ids, [12, 18], lora=adapter)
    assert torch.equal(lp_trainer, lp_engine)
    assert not torch.equal(lp_engine, engine.forward_logprobs(ids, [12, 18]))
    cache = engine.new_kv_cache(1)
    step = engine.prefill(cache, 0, ids[:12].tolist(), lora=adapter)
    decoded = step.logprobs[:-1].gather(1, ids[1:12, None])[:, 0]
    assert torch.equal(decoded, lp_trainer[1:12])
