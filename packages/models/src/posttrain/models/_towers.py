"""Frozen media towers: a small encoder that turns media features into decoder embeddings.

One module serves both towers; only the input differs:

* vision: an image ``[H, W, 3]`` uint8 is cut into ``p x p`` patches (row-major over the
  patch grid), each flattened in ``(row, column, channel)`` order and scaled by ``1/255``:
  ``[num_patches, p * p * 3]``;
* audio: discretised mel bins ``[frames, n_mels]`` uint8, scaled by ``1/255``.

Then, per row (so strict numerics keep every row's bits independent of its batch mates):

    x = input_proj(features)            [D]   (patch_embed / frame_embed)
    x = x + down(silu(gate(n)) * up(n))  with n = rms_norm(x, input_norm)
    y = projector(rms_norm(x, output_norm))   [hidden_size]

HF names (``model.vision_tower.*`` / ``model.audio_tower.*``, see ``_convert``):
``patch_embed.weight`` (vision) or ``frame_embed.weight`` (audio), ``input_norm.weight``,
``mlp.{gate,up,down}_proj.weight``, ``output_norm.weight``, ``projector.weight``.

Towers are frozen (``requires_grad=False``) and stay in eval mode while frozen (``train()``
leaves them in eval); nothing here has dropout, so eval changes no number, but a tower that
someone unfreezes on purpose follows ``train()`` again. ``tower_parameter_names`` and
``has_towers`` read the model's structure (the tower modules it holds), which is what weight
sync must key its "send the towers too" decision on (never a separate flag).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from posttrain.models._config import ModelConfig
from posttrain.models._ops import FastOps

TowerKind = Literal["vision", "audio"]
TOWER_PREFIX: dict[str, str] = {"vision": "model.vision_tower.", "audio": "model.audio_tower."}
"""HF name prefix of each tower's tensors."""
INPUT_PROJ_NAME: dict[str, str] = {"vision": "patch_embed", "audio": "frame_embed"}
"""HF name (under the prefix) of each tower's input projection."""


class MediaTower(nn.Module):
    """A frozen per-row encoder: input projection, one residual SwiGLU MLP, projector."""

    input_proj: nn.Parameter
    input_norm: nn.Parameter
    fc1: nn.Parameter
    fc2: nn.Parameter
    output_norm: nn.Parameter
    proj: nn.Parameter

    def __init__(
        self,
        kind: TowerKind,
        *,
        in_features: int,
        width: int,
        intermediate: int,
        out_features: int,
        dtype: torch.dtype,
        eps: float,
    ) -> None:
        super().__init__()
        self.kind: TowerKind = kind
        self.eps = eps
        frozen = {"requires_grad": False}
        self.input_proj = nn.Parameter(torch.zeros(width, in_features, dtype=dtype), **frozen)
        self.input_norm = nn.Parameter(torch.ones(width, dtype=dtype), **frozen)
        self.fc1 = nn.Parameter(torch.zeros(2 * intermediate, width, dtype=dtype), **frozen)
        self.fc2 = nn.Parameter(torch.zeros(width, intermediate, dtype=dtype), **frozen)
        self.output_norm = nn.Parameter(torch.ones(width, dtype=dtype), **frozen)
        self.proj = nn.Parameter(torch.zeros(out_features, width, dtype=dtype), **frozen)
        self.eval()

    @property
    def frozen(self) -> bool:
        """True while no tower parameter requires grad (the default)."""
        return not any(p.requires_grad for p in self.parameters())

    def train(self, mode: bool = True) -> MediaTower:
        """Follow ``mode`` only when unfrozen: a frozen tower stays in eval mode."""
        return super().train(mode and not self.frozen)

    def encode(self, ops: type[FastOps], features: Tensor) -> Tensor:
        """``features[N, in_features]`` fp32 -> embeddings ``[N, out_features]`` fp32."""
        x = ops.linear(features, self.input_proj)
        n = ops.rms_norm(x, self.input_norm, self.eps)
        gu = ops.linear(n, self.fc1)
        i = self.fc2.shape[1]
        x = x + ops.linear(ops.silu_mul(gu[:, :i], gu[:, i:]), self.fc2)
        return ops.linear(ops.rms_norm(x, self.output_norm, self.eps), self.proj)


def build_towers(config: ModelConfig) -> dict[str, MediaTower]:
    """The towers ``config`` asks for, by attribute name (``vision_tower``, ``audio_tower``)."""
    out: dict[str, MediaTower] = {}
    common = {"out_features": config.hidden_size, "dtype": config.dtype, "eps": config.rms_norm_eps}
    if config.has_vision_tower:
        p = config.vision_patch_size
        out["vision_tower"] = MediaTower(
            "vision",
            in_features=p * p * 3,
            width=config.vision_hidden_size,
            intermediate=config.vision_intermediate_size,
            **common,  # type: ignore[arg-type]
        )
    if config.has_audio_tower:
        out["audio_tower"] = MediaTower(
            "audio",
            in_features=config.audio_num_mel_bins,
            width=config.audio_hidden_size,
            intermediate=config.audio_intermediate_size,
            **common,  # type: ignore[arg-type]
        )
    return out


def image_patches(image: Tensor, patch_size: int) -> Tensor:
    """``image[H, W, 3]`` uint8 -> ``[(H/p) * (W/p), p * p * 3]`` fp32 in [0, 1] (row-major)."""
    h, w, c = image.shape
    p = patch_size
    grid = image.reshape(h // p, p, w // p, p, c).permute(0, 2, 1, 3, 4)
    return grid.reshape((h // p) * (w // p), p * p * c).float() / 255.0


def mel_features(mel: Tensor) -> Tensor:
    """Discretised mel bins ``[frames, n_mels]`` uint8 -> fp32 in [0, 1]."""
    return mel.float() / 255.0


def _towers_of(model: nn.Module) -> list[tuple[str, MediaTower]]:
    return [(path, m) for path, m in model.named_modules() if isinstance(m, MediaTower)]


def has_towers(model: nn.Module) -> bool:
    """Whether ``model`` holds a media tower (found in its module tree, wrappers included).

    Weight sync keys "send the tower weights too" on this (the model's structure), never on a
    separate flag: a removed or renamed flag would silently stop the towers from being
    re-sent after an engine's offload/onload cycle (trap 3 of issue 25).
    """
    return bool(_towers_of(model))


def tower_parameter_names(model: nn.Module) -> list[str]:
    """HF names of every tower tensor ``model`` holds (what a tower re-sync must send).

    Derived from the tower modules in the module tree (see ``has_towers``); sorted by the
    tower's order in the model, then the tensor's order in ``weight_groups``.
    """
    names: list[str] = []
    for _, tower in _towers_of(model):
        names.extend(tower_hf_names(tower.kind))
    return names


def tower_hf_names(kind: str) -> list[str]:
    """The HF tensor names of one tower of ``kind`` (``vision`` or ``audio``), in the order of
    its weight groups (``_convert._tower_groups``: the one list of them; names do not depend
    on the sizes)."""
    from posttrain.models._convert import _tower_groups

    return [name for group in _tower_groups(kind, 1, 1, 1, 1) for name in group.hf_names]
