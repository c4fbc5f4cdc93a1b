"""The trainer side of SGLang's distributed weight update, for a set of engines.

``push_distributed`` forms a weight-update group with the engines (``/init_weights_update_group``
to each, posted concurrently, while the caller joins as rank 0 and hosts the rendezvous; engine
``i`` takes ``rank_offset`` 1 + the TP sizes before it), then per bucket posts
``/update_weights_from_distributed`` to every engine and broadcasts the bucket's tensors, and
finally ``/destroy_weights_update_group`` everywhere. The last bucket carries ``flush_cache``
and the new ``weight_version``: the update's end, where an engine that stages (posttrain's local
engine) commits. A failure anywhere stops sending; the group is destroyed on every engine it was
formed on (which drops an update begun and not completed there), and the error names the engine,
the route and the engine's message.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from posttrain.formats._buckets import bucket_request, plan_buckets
from posttrain.formats._engine_client import EngineClient
from posttrain.formats._errors import UpdateGroupError
from posttrain.formats._sglang_requests import (
    DEFAULT_GROUP_NAME,
    DestroyWeightsUpdateGroupReq,
    InitWeightsUpdateGroupReq,
)
from posttrain.formats._update_group import UpdateGroup, join_update_group

__all__ = ["DEFAULT_BUCKET_BYTES", "free_port", "push_distributed"]

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


def free_port(address: str) -> int:
    """A TCP port free on ``address`` now (the rendezvous binds it next)."""
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def _wait(futures: Sequence[Future[Any]]) -> None:
    errors = []
    for f in futures:
        try:
            f.result()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def _on(backend: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` where the backend reads it: host memory for gloo, the current GPU for nccl."""
    if backend == "gloo":
        return t.detach().cpu().contiguous()
    return t.detach().to(f"cuda:{torch.cuda.current_device()}").contiguous()


def _join_watching(inits: Sequence[Future[Any]], **group: Any) -> UpdateGroup:
    """Join as rank 0 while the engines' init requests run; an engine that refuses or cannot
    be reached fails the join at once with its own error (the rendezvous, left waiting in its
    thread, then times out by itself)."""
    joined: Future[UpdateGroup] = Future()

    def join() -> None:
        try:
            joined.set_result(join_update_group(rank=0, **group))
        except BaseException as exc:
            joined.set_exception(exc)

    threading.Thread(target=join, name="update-group-join", daemon=True).start()
    done, _ = wait([joined, *inits], return_when=FIRST_EXCEPTION)
    for f in inits:
        if f in done and f.exception() is not None:
            raise f.exception()  # type: ignore[misc]
    _wait(inits)
    return joined.result()


def push_distributed(
    clients: Sequence[EngineClient],
    tensors: Sequence[tuple[str, torch.Tensor]],
    *,
    weight_version: int | None,
    backend: str = "gloo",
    master_address: str = "127.0.0.1",
    tp_sizes: Sequence[int] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    group_name: str = DEFAULT_GROUP_NAME,
    timeout_s: float = 300.0,
) -> int:
    """Send ``tensors`` to every engine in ``clients``; returns the bytes broadcast.

    Each tensor travels in the dtype and shape the engines hold, from host memory on gloo and
    from the current GPU on nccl (copied there, one bucket at a time, when it is elsewhere).
    """
    if not clients:
        return 0
    sizes = list(tp_sizes) if tp_sizes is not None else [1] * len(clients)
    offsets = [1 + sum(sizes[:i]) for i in range(len(clients))]
    world = 1 + sum(sizes)
    port = free_port(master_address)
    joined: list[EngineClient] = []
    group: UpdateGroup | None = None
    buckets = plan_buckets([(n, t.contiguous()) for n, t in tensors], bucket_bytes)
    with ThreadPoolExecutor(max_workers=len(clients)) as pool:

        def post(client: EngineClient, route: str, body: Any) -> Future[Any]:
            return pool.submit(client.post, route, body, timeout_s=timeout_s)

        try:
            inits = [
                post(
                    c,
                    "/init_weights_update_group",
                    InitWeightsUpdateGroupReq(
                        master_address=master_address,
                        master_port=port,
                        rank_offset=off,
                        world_size=world,
                        group_name=group_name,
                        backend=backend,  # type: ignore[arg-type]
                    ),
                )
                for c, off in zip(clients, offsets, strict=True)
            ]
            joined = list(clients)
            group = _join_watching(
                inits,
                master_address=master_address,
                master_port=port,
                world_size=world,
                group_name=group_name,
                backend=backend,
                timeout_s=timeout_s,
            )
            for k, bucket in enumerate(buckets):
                req = bucket_request(
                    bucket,
                    last=k == len(buckets) - 1,
                    weight_version=weight_version,
                    group_name=group_name,
                )
                sent = [post(c, "/update_weights_from_distributed", req) for c in clients]
                try:
                    group.broadcast([_on(backend, t) for _, t in bucket])
                except UpdateGroupError as exc:
                    _wait(sent)  # an engine's own answer names the cause better, if it has one
                    raise exc
                _wait(sent)
        finally:
            if group is not None:
                group.destroy()
            ends = [
                post(c, "/destroy_weights_update_group", DestroyWeightsUpdateGroupReq(
                    group_name=group_name))
                for c in joined
            ]  # fmt: skip
            for f in ends:  # best effort: an engine that never joined has nothing to drop
                f.exception()
    return sum(t.numel() * t.element_size() for _, t in tensors)
