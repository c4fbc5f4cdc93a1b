"""Optional ``torch.compile`` of each decoder layer's forward (fast numerics only).

``compile_layers(model)`` replaces every layer's ``forward`` (an instance attribute, so the
module, its parameters, names and hooks stay what they were) by a ``torch.compile`` of it.
Only the layer's own compute is compiled: module hooks run outside the compiled region, so
FSDP2's per-layer all-gather, reshard and gradient reduction hooks stay eager, and a caller
shards first and compiles after (``posttrain.grpo.trainer.shard_policy`` does). Each layer is
its own compiled region, so a failure or a graph break stays inside one layer.

Shapes are dynamic (``dynamic=True``): packed micro-batches of varying length reuse one graph
per layer and grad mode instead of recompiling every step. Each layer specialises on its
index (a Python int the layer reads), so dynamo's per-code-object recompile limit is raised
to cover every layer (never lowered).

``mode`` is ``torch.compile``'s (``COMPILE_MODES``): ``default``; ``reduce-overhead`` (CUDA
graphs: each compiled layer's forward and backward replay as one graph launch, which needs
the layer free of host syncs and graph breaks, see below); ``max-autotune`` (autotuned
matmul and pointwise kernels, and CUDA graphs) and ``max-autotune-no-cudagraphs`` (autotuning
only). A mode names inductor's settings, so it needs the inductor backend; with any other
backend (``aot_eager`` in tests) only ``default`` is accepted.

What a fast layer's compiled forward and backward hold (issue 37): dense layers and, in bf16
compute where ``torch._grouped_mm`` runs (``_model.use_grouped_mm``), MoE layers trace as one
graph with no host sync (routing, the sort by expert and the group offsets stay on the
device; the packed layout's facts come from the host lengths). A MoE layer in fp32 compute
(or where the grouped GEMM is unavailable) runs its per-expert loop eagerly: one clean graph
break and one host sync (the group sizes) per MoE layer forward, so CUDA graphs then cover
the parts before and after the loop.

A compile that cannot start (no compiler, an unsupported Python) or whose first call fails
in dynamo or inductor warns once with the error and runs every layer eagerly from then on;
results are the same math either way (fast numerics: tolerance, not bits). Strict numerics
are refused: compiled kernels reorder reductions, and strict's contract is bits.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from torch import Tensor, nn

from posttrain.models._errors import ModelInputError

if TYPE_CHECKING:
    from collections.abc import Callable

    from posttrain.models._model import DecoderModel

__all__ = [
    "BACKEND_ENV",
    "COMPILE_MODES",
    "CompileMode",
    "check_compile_mode",
    "compile_layers",
    "layers_compiled",
]

_COMPILE_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, NotImplementedError)
"""What a failed compile raises on the first call (dynamo's and inductor's errors are
``RuntimeError`` subclasses; ``torch.compile`` itself raises ``RuntimeError`` where it cannot
run). Errors of the model's own (``ModelsError``) are re-raised, never swallowed."""


class _CompiledForward:
    """A layer's ``forward``: the compiled one, or the eager one once compiling has failed."""

    def __init__(
        self, eager: Callable[..., Tensor], compiled: Callable[..., Tensor], state: _State
    ) -> None:
        self.eager = eager
        self.compiled = compiled
        self.state = state

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        if self.state.failed is None:
            try:
                with _backward_compiled_with_forward():
                    return self.compiled(*args, **kwargs)
            except _COMPILE_ERRORS as err:
                from posttrain.models._errors import ModelsError

                if isinstance(err, ModelsError):
                    raise
                self.state.fail(err)
        return self.eager(*args, **kwargs)


def _backward_compiled_with_forward() -> contextlib.AbstractContextManager[Any]:
    """Compile a graph's backward when its forward compiles (AOTAutograd defers it otherwise),
    so a backward that cannot compile fails here, where the eager fallback can still run,
    not inside ``loss.backward()``."""
    config = torch._functorch.config
    if hasattr(config, "force_non_lazy_backward_lowering"):
        patched: contextlib.AbstractContextManager[Any] = config.patch(
            force_non_lazy_backward_lowering=True
        )
        return patched
    return contextlib.nullcontext()


class _State:
    """Whether a model's compiled layers still run compiled (``failed`` holds why not)."""

    def __init__(self) -> None:
        self.failed: str | None = None

    def fail(self, err: BaseException) -> None:
        self.failed = (
            f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err) else ''}"
        )
        warnings.warn(
            f"torch.compile of the decoder layers failed ({self.failed}); every layer runs "
            "eagerly from now on (same math, no compile speed-up)",
            RuntimeWarning,
            stacklevel=3,
        )


def layers_compiled(model: nn.Module) -> bool:
    """Whether ``compile_layers`` compiled ``model``'s layers and they still run compiled."""
    state = getattr(model, "_compile_state", None)
    return isinstance(state, _State) and state.failed is None


def _raise_recompile_limit(entries: int) -> None:
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < entries:
        setattr(config, name, entries)


CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
"""``torch.compile``'s ``mode`` for the decoder layers (see the module doc)."""

COMPILE_MODES: tuple[str, ...] = get_args(CompileMode)
"""Every ``CompileMode``, in order."""


def check_compile_mode(mode: object, what: str = "compile mode") -> CompileMode:
    """``mode`` when it is one of ``COMPILE_MODES``; else a ``ModelInputError`` naming ``what``
    (the caller's flag or field) and the choices."""
    if mode not in COMPILE_MODES:
        raise ModelInputError(f"{what}={mode!r} is not one of {', '.join(COMPILE_MODES)}")
    return mode  # type: ignore[return-value]


BACKEND_ENV = "POSTTRAIN_COMPILE_BACKEND"
"""Environment variable naming the ``torch.compile`` backend when the caller names none
(default ``inductor``; ``aot_eager`` traces without generating code, to tell a tracing
problem from a code-generation one, and runs where no C compiler is)."""


def compile_layers(
    model: DecoderModel,
    *,
    backend: str | Callable[..., Any] | None = None,
    dynamic: bool = True,
    mode: CompileMode = "default",
    fullgraph: bool = False,
) -> bool:
    """Compile each decoder layer's forward of ``model`` (fast numerics); True when compiled.

    Call after any sharding (FSDP2 ``fully_shard`` of the layers): the hooks stay outside the
    compiled forwards. ``backend``: a ``torch.compile`` backend (default:
    ``$POSTTRAIN_COMPILE_BACKEND`` or ``inductor``; ``"aot_eager"`` generates no code, for
    tests without a C compiler). ``mode``: ``torch.compile``'s mode (``COMPILE_MODES``; other
    than ``default`` only with inductor). ``fullgraph``: a graph break is an error (which the
    eager fallback then takes, with its warning) instead of a split graph. Returns False,
    with a warning, where ``torch.compile`` cannot start here; the layers then run eagerly.
    """
    from posttrain.models._model import Numerics, run_experts_loop_eagerly

    backend = backend or os.environ.get(BACKEND_ENV) or "inductor"
    check_compile_mode(mode)
    if mode != "default" and backend != "inductor":
        raise ModelInputError(
            f"compile mode {mode!r} sets inductor options; backend {backend!r} takes only "
            "'default' (unset $POSTTRAIN_COMPILE_BACKEND, or use mode 'default')"
        )

    if model.numerics is not Numerics.FAST:
        raise ModelInputError(
            "compile needs fast numerics (numerics='fast'): strict kernels keep their bit-exact "
            "order and are never compiled"
        )
    if isinstance(getattr(model, "_compile_state", None), _State):
        raise ModelInputError("the model's layers are already compiled")
    run_experts_loop_eagerly()  # the experts' data-dependent loop: a graph break, once
    layers = list(model.layers)
    state = _State()
    try:
        compiled = [
            torch.compile(
                layer.forward,
                backend=backend,
                dynamic=dynamic,
                mode=None if mode == "default" else mode,
                fullgraph=fullgraph,
            )
            for layer in layers
        ]
    except _COMPILE_ERRORS as err:
        state.fail(err)
        return False
    # per layer: grad and no-grad graphs, each possibly recompiled once (a dynamic dim)
    _raise_recompile_limit(4 * len(layers) + 8)
    for layer, fn in zip(layers, compiled, strict=True):
        object.__setattr__(layer, "forward", _CompiledForward(layer.forward, fn, state))
    object.__setattr__(model, "_compile_state", state)
    return True
