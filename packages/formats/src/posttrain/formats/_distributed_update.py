"""The trainer side of SGLang's distributed weight update, for a set of engines.

``WeightUpdateGroup`` is the trainer's end of a group kept across updates (a run forms it once
and closes it at exit); ``push_distributed`` is one update in a group of its own.
Forming posts ``/init_weights_update_group`` to each engine, concurrently, while the caller
joins as rank 0 and hosts the rendezvous (engine ``i`` takes ``rank_offset`` 1 + the TP sizes
before it); an update posts, per bucket, ``/update_weights_from_distributed`` to every engine
and broadcasts the bucket's tensors; closing posts ``/destroy_weights_update_group``
everywhere. The last bucket carries ``flush_cache``
and the new ``weight_version``: the update's end, where an engine that stages (posttrain's local
engine) commits. A failure anywhere stops sending; the group is destroyed on every engine it was
formed on (which drops an update begun and not completed there), and the error names the engine,
the route and the engine's message.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Collection, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from posttrain.formats._buckets import bucket_request, flat_bytes, flat_order, plan_buckets
from posttrain.formats._engine_client import EngineClient
from posttrain.formats._errors import UpdateGroupError
from posttrain.formats._sglang_requests import (
    DEFAULT_GROUP_NAME,
    DestroyWeightsUpdateGroupReq,
    InitWeightsUpdateGroupReq,
)
from posttrain.formats._update_group import UpdateGroup, join_update_group

__all__ = ["DEFAULT_BUCKET_BYTES", "WeightUpdateGroup", "free_port", "push_distributed"]

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


class WeightUpdateGroup:
    """The trainer's end of one weight-update group with a set of engines, kept across updates.

    ``WeightUpdateGroup.form`` posts ``/init_weights_update_group`` to every engine (concurrently)
    while joining as rank 0; ``push`` sends one update (any number of times); ``close`` leaves
    the group and posts ``/destroy_weights_update_group`` to every engine it was formed on (best
    effort: which also drops an update begun and not completed there). A ``push`` that fails
    leaves the group unusable (a broadcast may have stopped midway): the caller closes it and
    forms a new one.
    """

    def __init__(
        self,
        clients: Sequence[EngineClient],
        *,
        backend: str,
        master_address: str,
        group_name: str,
        timeout_s: float,
    ) -> None:
        self.clients = list(clients)
        self.backend = backend
        self.master_address = master_address
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.usable = False
        self._group: UpdateGroup | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.clients)))

    @classmethod
    def form(
        cls,
        clients: Sequence[EngineClient],
        *,
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        tp_sizes: Sequence[int] | None = None,
        group_name: str = DEFAULT_GROUP_NAME,
        timeout_s: float = 300.0,
    ) -> WeightUpdateGroup:
        """Form the group (engine ``i`` at ``rank_offset`` 1 + the TP sizes before it); an
        engine that refuses or cannot be reached raises its ``EngineError``, after the group
        was destroyed on every engine."""
        self = cls(
            clients,
            backend=backend,
            master_address=master_address,
            group_name=group_name,
            timeout_s=timeout_s,
        )
        sizes = list(tp_sizes) if tp_sizes is not None else [1] * len(self.clients)
        offsets = [1 + sum(sizes[:i]) for i in range(len(self.clients))]
        world = 1 + sum(sizes)
        port = free_port(master_address)
        try:
            inits = [
                self._post(
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
                for c, off in zip(self.clients, offsets, strict=True)
            ]
            self._group = _join_watching(
                inits,
                master_address=master_address,
                master_port=port,
                world_size=world,
                group_name=group_name,
                backend=backend,
                timeout_s=timeout_s,
            )
        except BaseException:
            self.close()
            raise
        self.usable = True
        return self

    def _post(self, client: EngineClient, route: str, body: Any) -> Future[Any]:
        return self._pool.submit(client.post, route, body, timeout_s=self.timeout_s)

    @property
    def urls(self) -> tuple[str, ...]:
        """The engines of the group, in rank order."""
        return tuple(c.base_url for c in self.clients)

    def push(
        self,
        tensors: Sequence[tuple[str, torch.Tensor]],
        *,
        weight_version: int | None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        flattened: bool = True,
    ) -> int:
        """Send ``tensors`` to every engine of the group; returns the bytes broadcast.

        Each tensor travels in the dtype and shape the engines hold, from host memory on gloo
        and from the current GPU on nccl (copied there, one bucket at a time, when it is
        elsewhere). The last bucket carries ``flush_cache`` and ``weight_version``.
        ``flattened`` (SGLang's ``load_format="flattened_bucket"``): a bucket is one broadcast
        of its bytes end to end, wider items first, instead of one broadcast per tensor.
        """
        if self._group is None or not self.usable:
            raise UpdateGroupError(
                f"update group {self.group_name!r}: unusable after a failed update (form anew)"
            )
        group = self._group
        self.usable = False  # until this update completes
        buckets = plan_buckets([(n, t.contiguous()) for n, t in tensors], bucket_bytes)
        for k, planned in enumerate(buckets):
            bucket = flat_order(planned) if flattened else planned
            req = bucket_request(
                bucket,
                last=k == len(buckets) - 1,
                weight_version=weight_version,
                group_name=self.group_name,
                flattened=flattened,
            )
            wire = [_on(self.backend, t) for _, t in bucket]
            if flattened:
                wire = [flat_bytes(list(zip(req.names, wire, strict=True)))]
            sent = [self._post(c, "/update_weights_from_distributed", req) for c in self.clients]
            try:
                group.broadcast(wire)
            except UpdateGroupError as exc:
                _wait(sent)  # an engine's own answer names the cause better, if it has one
                raise exc
            _wait(sent)
        self.usable = True
        return sum(t.numel() * t.element_size() for _, t in tensors)

    def close(self, *, leave_out: Collection[str] = ()) -> None:
        """Leave the group and destroy it on every engine but those in ``leave_out`` (by URL:
        engines known to be unreachable, which would only cost a timeout each); best effort,
        as an engine that never joined, or is gone, has nothing to drop."""
        self.usable = False
        if self._group is not None:
            self._group.destroy()
            self._group = None
        skip = {url.rstrip("/") for url in leave_out}
        ends = [
            self._post(c, "/destroy_weights_update_group", DestroyWeightsUpdateGroupReq(
                group_name=self.group_name))
            for c in self.clients
            if c.base_url not in skip
        ]  # fmt: skip
        for f in ends:
            f.exception()
        self._pool.shutdown(wait=True)


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
    flattened: bool = True,
) -> int:
    """One update in a group of its own: ``WeightUpdateGroup.form``, ``push``, ``close``;
    returns the bytes broadcast."""
    if not clients:
        return 0
    group = WeightUpdateGroup.form(
        clients,
        backend=backend,
        master_address=master_address,
        tp_sizes=tp_sizes,
        group_name=group_name,
        timeout_s=timeout_s,
    )
    try:
        return group.push(
            tensors, weight_version=weight_version, bucket_bytes=bucket_bytes, flattened=flattened
        )
    finally:
        group.close()
