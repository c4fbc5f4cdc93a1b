"""posttrain.lora: adapter-only LoRA that stays correct under TP/EP/PP/DP.

Attach LoRA to ``nn.Linear``, this package's TP-sharded linears or megatron-core's parallel
linears (``attach_lora``), reduce its grads by explicit rules (``reduce_lora_grads``), measure the
true global grad norm (``lora_grad_norm``), assemble the full PEFT adapter on every rank
(``export_adapter``), save / strictly load PEFT files, repack tensors for CUDA IPC, and push
adapters to SGLang-compatible engines (``AdapterClient``).

Also public, for the packages that shard tensors over explicit process groups (grpo's megatron
backend): the collectives of ``comm`` (``group_size`` / ``group_rank``, ``all_gather_flat`` /
``reduce_scatter_flat`` / ``gather_rows``, and the autograd pairs ``copy_to_group`` /
``reduce_from_group`` and ``gather_from_seq`` / ``scatter_to_seq``), and
``init_full_factor``, the layout-independent initial value of one LoRA factor (a layer that
shards a factor its own way slices it, so every layout starts from the same adapter).
Other packages import these from ``posttrain.lora``, never from its modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from posttrain.formats import peft_key  # re-exported: the one PEFT key builder
from posttrain.lora._errors import (
    AdapterFormatError,
    AdapterPushError,
    ChecksumMismatchError,
    ExportError,
    LayoutError,
    LoraConfigError,
    LoraError,
    ReplicaMismatchError,
)
from posttrain.lora.attach import LoraGroups, LoraHandle, Target, attach_lora
from posttrain.lora.comm import (
    all_gather_flat,
    copy_to_group,
    gather_from_seq,
    gather_rows,
    group_rank,
    group_size,
    reduce_from_group,
    reduce_scatter_flat,
    scatter_to_seq,
)
from posttrain.lora.config import LoraConfig, init_full_factor
from posttrain.lora.experts import ExpertLinear, LoraExpertLinear
from posttrain.lora.export import export_adapter
from posttrain.lora.grads import lora_grad_norm, reduce_lora_grads, verify_replicas
from posttrain.lora.ipc import repack_for_ipc
from posttrain.lora.layers import LoraLinear, LoraParamTag
from posttrain.lora.parallel import ColumnShardedLinear, RowShardedLinear

if TYPE_CHECKING:
    from posttrain.formats import LoraServing, request_fields, serves_lora
    from posttrain.lora.client import AdapterCapabilities, AdapterClient
    from posttrain.lora.peft_io import load_peft, merge_into_base, read_peft, save_peft

# The engine client (httpx) and the PEFT file io (safetensors) load on first use, so importing
# the training core stays quick and does not open them. The request fields are
# posttrain.formats' (their one home), re-exported here under the names this package promised.
_LAZY = {
    **dict.fromkeys(["AdapterCapabilities", "AdapterClient"], "posttrain.lora.client"),
    **dict.fromkeys(["LoraServing", "request_fields", "serves_lora"], "posttrain.formats"),
    **dict.fromkeys(
        ["load_peft", "merge_into_base", "read_peft", "save_peft"], "posttrain.lora.peft_io"
    ),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'posttrain.lora' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "AdapterCapabilities",
    "AdapterClient",
    "AdapterFormatError",
    "AdapterPushError",
    "ChecksumMismatchError",
    "ColumnShardedLinear",
    "ExpertLinear",
    "ExportError",
    "LayoutError",
    "LoraConfig",
    "LoraConfigError",
    "LoraError",
    "LoraExpertLinear",
    "LoraGroups",
    "LoraHandle",
    "LoraLinear",
    "LoraParamTag",
    "LoraServing",
    "ReplicaMismatchError",
    "RowShardedLinear",
    "Target",
    "all_gather_flat",
    "attach_lora",
    "copy_to_group",
    "export_adapter",
    "gather_from_seq",
    "gather_rows",
    "group_rank",
    "group_size",
    "init_full_factor",
    "load_peft",
    "lora_grad_norm",
    "merge_into_base",
    "peft_key",
    "read_peft",
    "reduce_from_group",
    "reduce_lora_grads",
    "reduce_scatter_flat",
    "repack_for_ipc",
    "request_fields",
    "save_peft",
    "scatter_to_seq",
    "serves_lora",
    "verify_replicas",
]
