"""Public surface, config validation, layout-invariant init, tags and single-process rules."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import posttrain.lora as lora
from posttrain.interface import ConfigError, EngineError, LoraSpec, PosttrainError
from posttrain.lora import (
    LayoutError,
    LoraConfig,
    LoraConfigError,
    LoraLinear,
    attach_lora,
    lora_grad_norm,
    reduce_lora_grads,
    repack_for_ipc,
)
from posttrain.lora.attach import fused_local_parts, fused_local_rows


def test_all_is_exactly_the_public_surface() -> None:
    import inspect

    # everything posttrain.lora defines at top level (eager or lazy) that is public ...
    defined = (
        {
            n
            for n, v in vars(lora).items()
            if not n.startswith("_")
            and (inspect.isclass(v) or inspect.isfunction(v))
            and v.__module__.startswith("posttrain.lora")
        }
        | set(lora._LAZY)
        | {"peft_key"}
    )  # peft_key: re-exported from posttrain.formats
    assert set(lora.__all__) == defined
    assert len(lora.__all__) == len(set(lora.__all__))
    assert dir(lora) == sorted(lora.__all__)
    for name in lora.__all__:  # ... and every listed name resolves
        assert getattr(lora, name) is not None


def test_error_tree_is_rooted_in_interface() -> None:
    for name in (
        "LoraConfigError",
        "LayoutError",
        "ReplicaMismatchError",
        "ExportError",
        "AdapterFormatError",
        "AdapterPushError",
        "ChecksumMismatchError",
    ):
        assert issubclass(getattr(lora, name), lora.LoraError)
    assert issubclass(lora.LoraError, PosttrainError)
    assert issubclass(LoraConfigError, ConfigError)
    assert issubclass(lora.AdapterPushError, EngineError)


def test_config_validation_names_the_field() -> None:
    with pytest.raises(LoraConfigError, match=r"LoraConfig\.r"):
        LoraConfig(r=0, alpha=8)
    with pytest.raises(LoraConfigError, match="allow_dropout"):
        LoraConfig(r=4, alpha=8, dropout=0.1)
    assert LoraConfig(r=4, alpha=8, dropout=0.1, allow_dropout=True).dropout == 0.1
    with pytest.raises(LoraConfigError, match="alpha"):
        LoraConfig(r=4, alpha=-1)
    with pytest.raises(LoraConfigError, match="export_dtype"):
        LoraConfig(r=4, alpha=8, export_dtype=torch.int8)
    assert LoraConfig(r=16, alpha=32).scaling == 2.0
    assert LoraConfig(r=16, alpha=32, use_rslora=True).scaling == 8.0


def test_from_spec_uses_the_interface_spec() -> None:
    spec = LoraSpec(r=8, alpha=16, target_modules=("q_proj", "v_proj"), use_rslora=True)
    cfg = LoraConfig.from_spec(spec, export_dtype=torch.float32)
    assert (cfg.r, cfg.alpha, cfg.use_rslora, cfg.export_dtype) == (8, 16.0, True, torch.float32)
    assert cfg.scaling == pytest.approx(spec.scaling)
    with pytest.raises(LoraConfigError, match="allow_dropout"):
        LoraConfig.from_spec(LoraSpec(r=4, alpha=4, target_modules=("q_proj",), dropout=0.1))


def test_attach_freezes_base_and_tags_factors() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    attach_lora(model, LoraConfig(r=2, alpha=4), {"0": lora.Target(), "2": lora.Target()})
    assert isinstance(model[0], LoraLinear)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["0.lora_A", "0.lora_B", "2.lora_A", "2.lora_B"]
    a = model[0].lora_A
    assert a.tensor_model_parallel is False
    assert a.allreduce is True
    assert torch.count_nonzero(model[0].lora_B) == 0  # b_init zero: starts as the base model
    with pytest.raises(LayoutError, match="already attached"):
        attach_lora(model, LoraConfig(r=2, alpha=4), {"0": lora.Target()})
    with pytest.raises(LoraConfigError, match="no module matches"):
        attach_lora(nn.Sequential(nn.Linear(2, 2)), LoraConfig(r=1, alpha=1), ["q_proj"])
    with pytest.raises(LayoutError, match="cannot attach"):
        attach_lora(nn.Sequential(nn.Conv1d(2, 2, 1)), LoraConfig(r=1, alpha=1), ["0"])


def test_forward_op_order_is_the_documented_one() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(6, 5)
    model = nn.Sequential(lin)
    attach_lora(model, LoraConfig(r=3, alpha=6, b_init="normal"), ["0"])
    site = model[0]
    x = torch.randn(4, 6)
    expected = lin(x) + ((x @ site.lora_A.T) @ site.lora_B.T) * 2.0
    assert torch.equal(model(x), expected)
    site.enabled = False
    assert torch.equal(model(x), lin(x))


def test_single_process_reduce_is_identity_and_norm_is_l2() -> None:
    model = nn.Sequential(nn.Linear(6, 5))
    handle = attach_lora(model, LoraConfig(r=2, alpha=2, b_init="normal"), ["0"])
    model(torch.randn(3, 6)).pow(2).sum().backward()
    before = [p.grad.clone() for p in handle.parameters()]
    reduce_lora_grads(handle)
    assert all(torch.equal(b, p.grad) for b, p in zip(before, handle.parameters(), strict=True))
    expected = math.sqrt(sum(float(g.double().pow(2).sum()) for g in before))
    assert lora_grad_norm(handle) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(LoraConfigError, match="overlap_grad_reduce"):
        reduce_lora_grads(handle, overlap_grad_reduce=True)


@settings(max_examples=25, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4]),
    groups=st.sampled_from([None, 4, 8]),
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3),
)
def test_fused_rows_round_trip(tp: int, groups: int | None, sizes: list[int]) -> None:
    g = groups or tp
    if g % tp:
        return
    full = [torch.randn(s * g * 2, 3) for s in sizes]
    locals_ = [fused_local_rows(full, groups, r, tp) for r in range(tp)]
    per_rank = [fused_local_parts(loc, [p.shape[0] for p in full], groups, tp) for loc in locals_]
    for j, part in enumerate(full):
        assert torch.equal(torch.cat([per_rank[r][j] for r in range(tp)]), part)


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 7)), min_size=1, max_size=6),
    dtypes=st.lists(
        st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), min_size=6, max_size=6
    ),
)
def test_repack_one_storage_per_dtype(
    shapes: list[tuple[int, int]], dtypes: list[torch.dtype]
) -> None:
    tensors = {f"t{i}": torch.randn(s).to(dtypes[i]) for i, s in enumerate(shapes)}
    tensors["view"] = torch.randn(7, 5).T  # a non-contiguous view
    packed = repack_for_ipc(tensors)
    assert list(packed) == list(tensors)
    storages = {(t.dtype, t.untyped_storage().data_ptr()) for t in packed.values()}
    assert len(storages) == len({t.dtype for t in tensors.values()})
    for k, t in tensors.items():
        assert torch.equal(packed[k], t)
        assert packed[k].is_contiguous()
        assert (packed[k].data_ptr() - packed[k].untyped_storage().data_ptr()) % 256 == 0
        assert packed[k].untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_export_errors_name_the_problem() -> None:
    model = nn.Sequential(
        lora.ColumnShardedLinear(4, 6, tp_group=None), lora.ColumnShardedLinear(6, 2, tp_group=None)
    )
    handle = attach_lora(model, LoraConfig(r=2, alpha=2), ["0", "1"])
    model[1].lora_B.data = model[1].lora_B.data.to(torch.bfloat16)
    with pytest.raises(
        lora.ExportError, match=r"mixed dtypes .*bfloat16 \(base_model\.model\.1\.lora_B\.weight\)"
    ):
        lora.export_adapter(handle)
    lora.verify_replicas(handle)  # single process: nothing to compare, must not raise


def test_fold_scaling_serves_rslora_without_rslora(tmp_path: Path) -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 6))
    train = LoraConfig(r=4, alpha=8.0, use_rslora=True, b_init="normal", export_dtype=torch.float32)
    serve = LoraConfig(r=4, alpha=4.0, export_dtype=torch.float32)  # scaling 1.0, no rsLoRA
    ours = copy.deepcopy(base)
    handle = attach_lora(ours, train, ["0"])
    folded = lora.export_adapter(handle, fold_scaling_to=serve.scaling)
    lora.save_peft(tmp_path / "a", folded, serve)
    served = copy.deepcopy(base)
    lora.load_peft(attach_lora(served, serve, ["0"]), tmp_path / "a")
    x = torch.randn(3, 8)
    assert torch.allclose(served(x), ours(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(lora.ExportError, match="fold_scaling_to"):
        lora.export_adapter(handle, fold_scaling_to=0.0)


class _SiteWithKernel(nn.Module):
    """A linear site as ``posttrain.models`` declares one: its own kernel, dims and weight."""

    def __init__(self, d_in: int, d_out: int, calls: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in))
        self.in_features, self.out_features = d_in, d_out
        self.calls = calls

    def linear_kernel(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        self.calls.append(tuple(w.shape))
        return (x.double() @ w.double().T).float()  # a kernel unlike torch's matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_kernel(x, self.weight)


def test_a_linear_site_gets_lora_on_its_own_kernel() -> None:
    calls: list[tuple[int, ...]] = []
    model = nn.Sequential(_SiteWithKernel(6, 5, calls))
    cfg = LoraConfig(r=2, alpha=4.0, b_init="normal")
    handle = attach_lora(model, cfg, {"0": lora.Target(parts=(("q", 3), ("k", 2)))})
    site = handle.sites["0"]
    assert isinstance(site, LoraLinear)
    x = torch.randn(4, 6)
    calls.clear()
    y = model(x)
    assert calls == [(5, 6), (2, 6), (5, 2)]  # base, then A, then B: all on the site's kernel
    a, b = site.lora_A.detach(), site.lora_B.detach()
    base = (x.double() @ site.base.weight.detach().double().T).float()
    h = (x.double() @ a.double().T).float()
    assert torch.equal(y, base + (h.double() @ b.double().T).float() * cfg.scaling)
    exported = lora.export_adapter(handle)
    assert sorted(exported) == sorted(lora.peft_key(m, f) for m in ("q", "k") for f in ("A", "B"))


def test_a_module_without_kernel_or_weight_is_still_refused() -> None:
    class NotLinear(nn.Module):
        in_features, out_features = 3, 3

        def linear_kernel(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(LayoutError, match="cannot attach LoRA to NotLinear"):
        attach_lora(nn.Sequential(NotLinear()), LoraConfig(r=1, alpha=1.0), ["0"])
