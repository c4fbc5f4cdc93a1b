"""Every exchange format grpo uses, imported from one place.

These formats are moving into ``posttrain.formats`` (samples/1, the LoRA request fields, PEFT
files, wsync/1 and its trainer-side client, NVFP4 dequantization). Until that lands they are
imported from their current homes here and nowhere else in grpo, so the switch is this one
file. The wsync/1 client and NVFP4 dequantization still live in ``posttrain.local_engine``;
this is the only place grpo touches that package (grpo talks to engines over HTTP only).
"""

from __future__ import annotations

from posttrain.local_engine import WeightPushClient, dequantize_nvfp4, push_weights
from posttrain.lora import request_fields, save_peft
from posttrain.session_router import decode_samples

__all__ = [
    "WeightPushClient",
    "decode_samples",
    "dequantize_nvfp4",
    "push_weights",
    "request_fields",
    "save_peft",
]
