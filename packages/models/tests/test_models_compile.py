"""``compile_layers`` (issue 37): each decoder layer's forward under ``torch.compile`` in fast
numerics gives the eager forward and gradients within fp32 tolerance; a compile that fails
falls back to eager with a warning; strict numerics are refused.

The compile tests use dynamo's ``aot_eager`` backend: the real graph capture and autograd
tracing, without inductor's C++ code generation (minutes on this 2-core box); the GPU run
(``gpu_train_step.py --compile``) uses inductor.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from posttrain.models import (
    ModelConfig,
    ModelInputError,
    Numerics,
    build_model,
    compile_layers,
    layers_compiled,
)

CFG = ModelConfig.tiny(num_hidden_layers=2, max_position_embeddings=32)  # a dense, a MoE layer


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Each test compiles afresh: the layers of every model share one code object, whose
    cache entries (and recompile limit) would otherwise carry over from test to test."""
    torch._dynamo.reset()


def _step(model: Any, lens: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(0, CFG.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(0))
    lp = model.forward_logprobs(ids, lens)
    (lp * torch.linspace(-1.0, 1.0, lp.shape[0])).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lp.detach(), grads


def _assert_same(got: tuple[torch.Tensor, dict[str, torch.Tensor]], want: Any) -> None:
    torch.testing.assert_close(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, msg=name)


def test_compiled_fast_layers_equal_eager_forward_and_backward() -> None:
    eager = build_model(CFG, 5, numerics=Numerics.FAST)
    compiled = build_model(CFG, 5, numerics=Numerics.FAST)
    assert compile_layers(compiled, backend="aot_eager")
    for lens in ([6, 8], [5, 4, 3]):  # a new packing reuses the dynamic-shape graphs
        _assert_same(_step(compiled, lens), _step(eager, lens))
    assert layers_compiled(compiled)
    assert not layers_compiled(eager)
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]


def _broken_backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
    raise RuntimeError("no code generator here")


def _broken_backward(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
    raise RuntimeError("no backward code generator here")


def _forward_only_backend() -> Any:
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(fw_compiler=lambda gm, _inputs: gm, bw_compiler=_broken_backward)


@pytest.mark.parametrize("broken", ["forward", "backward"])
def test_a_failing_compile_warns_once_and_runs_eagerly(broken: str) -> None:
    """A backward that cannot compile fails with its forward (not in ``backward()``), so the
    eager fallback covers it too."""
    eager = build_model(CFG, 6, numerics=Numerics.FAST)
    model = build_model(CFG, 6, numerics=Numerics.FAST)
    backend = _broken_backend if broken == "forward" else _forward_only_backend()
    assert compile_layers(model, backend=backend)
    with pytest.warns(RuntimeWarning, match="torch.compile of the decoder layers failed"):
        got = _step(model, [7, 5])
    assert not layers_compiled(model)
    _assert_same(got, _step(eager, [7, 5]))


def test_strict_numerics_are_never_compiled() -> None:
    model = build_model(CFG, 1)
    with pytest.raises(ModelInputError, match="fast numerics"):
        compile_layers(model)


def _fullgraph_step(
    compute: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """A fast model whose layers are compiled with ``fullgraph=True`` (a graph break is an
    error, which the eager fallback reports with its warning), after one forward + backward;
    and that step's result. bf16 takes the grouped-GEMM expert path (``torch._grouped_mm``,
    which torch also runs on the CPU), as it does on CUDA."""
    import posttrain.models._model as model_module

    if compute == torch.bfloat16:
        monkeypatch.setattr(model_module, "use_grouped_mm", lambda *_: True)
    model = build_model(CFG, 9, numerics=Numerics.FAST)
    model.compute_dtype = compute
    assert compile_layers(model, backend="aot_eager", fullgraph=True)
    return model, _step(model, [6, 8, 3])


def test_fast_layers_compile_without_a_graph_break_or_host_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dense and the MoE layer's forward and backward in bf16 compute (what CUDA graphs,
    ``mode="reduce-overhead"``, need): one graph each, so no host sync inside; results as eager."""
    eager = build_model(CFG, 9, numerics=Numerics.FAST)
    eager.compute_dtype = torch.bfloat16
    model, got = _fullgraph_step(torch.bfloat16, monkeypatch)
    assert layers_compiled(model)  # a graph break would have fallen back to eager
    want = _step(eager, [6, 8, 3])
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=5e-2, atol=5e-3, msg=name)


def test_an_fp32_moe_layer_breaks_its_graph_at_the_expert_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fp32 compute has no grouped GEMM under compile (torch's ``_grouped_mm`` traces bf16
    only): the per-expert loop (a host sync for its group sizes) is the one graph break, so
    ``fullgraph=True`` falls back to eager with the warning."""
    with pytest.warns(RuntimeWarning, match="torch.compile of the decoder layers failed"):
        model, _ = _fullgraph_step(torch.float32, monkeypatch)
    assert not layers_compiled(model)


def test_a_compile_mode_is_checked_and_needs_inductor() -> None:
    model = build_model(CFG, 2, numerics=Numerics.FAST)
    with pytest.raises(ModelInputError, match="compile mode='fast' is not one of default"):
        compile_layers(model, mode="fast")  # type: ignore[arg-type]
    with pytest.raises(ModelInputError, match="backend 'aot_eager' takes only 'default'"):
        compile_layers(model, backend="aot_eager", mode="reduce-overhead")
    assert not layers_compiled(model)
