"""``repack_for_ipc``: copy tensors into one fresh buffer per (dtype, device), return views.

Why: a CUDA IPC handle exports a whole storage. Params allocated in a cuMem/VMM pool (e.g. under
torch_memory_saver) cannot be exported by legacy CUDA IPC at all ("invalid argument"), and
exporting views of many separate storages costs one handle each. One fresh caching-allocator
buffer per (dtype, device) gives exactly one handle per buffer (torch memoises storages when
pickling), and decouples the payload from params the next optimizer step mutates. Keep the
returned tensors alive until the engine acknowledges the load. Offsets are aligned to
``alignment`` bytes so each view starts on a kernel-friendly boundary.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import torch


def repack_for_ipc(
    tensors: Mapping[str, torch.Tensor], *, alignment: int = 256
) -> dict[str, torch.Tensor]:
    """Views into fresh contiguous buffers, one buffer per (dtype, device), keys in input order."""
    groups: dict[tuple[torch.dtype, torch.device], list[str]] = defaultdict(list)
    for name, t in tensors.items():
        groups[(t.dtype, t.device)].append(name)
    out: dict[str, torch.Tensor] = {}
    for (dtype, device), names in groups.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        step = max(1, alignment // itemsize)
        offsets, total = [], 0
        for name in names:
            offsets.append(total)
            total += -(-tensors[name].numel() // step) * step
        buf = torch.empty(total, dtype=dtype, device=device)
        for name, off in zip(names, offsets, strict=True):
            t = tensors[name]
            view = buf[off : off + t.numel()].view(t.shape)
            view.copy_(t.detach())
            out[name] = view
    return {name: out[name] for name in tensors}
