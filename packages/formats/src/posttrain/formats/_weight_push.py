"""The trainer side of wsync/1: one ``WeightSink`` client over HTTP or shared memory.

``WeightPushClient`` implements the interface's ``WeightSink``: ``begin(WeightUpdateBegin)``,
``send_bucket(manifest, payload)``, ``end``, ``abort``, against an engine's routes
(``/begin_weight_update``, ``/update_weights_from_safetensors`` or ``/update_weights_from_shm``,
``/end_weight_update``, ``/abort_weight_update``). Any non-200 reply raises: 409 is
``StaleVersionError``, a failed ``end`` that lists missing tensors ``IncompleteUpdateError``,
anything else ``EngineError`` naming the URL and status. ``release_memory_occupation`` /
``resume_memory_occupation`` drive an engine's offload/onload cycle (SGLang's routes).

``push_weights`` sends a whole update: it packs named tensors greedily, in order, into buckets of
at most ``bucket_bytes`` (aligned offsets, so mixed dtypes share a bucket; a tensor larger than
the cap travels alone), opens the update with the full expected list, sends each bucket and ends.
It takes any ``WeightSink`` (a user's own engine in process, say): such a sink gets each bucket's
packed bytes through ``send_bucket``; only ``WeightPushClient`` can send through shared memory.

Shared memory is a two-slot ring in one file under ``/dev/shm``, mapped once: bucket k is packed
straight into slot ``k % 2`` (one copy), and a slot is reused only after the engine's reply for
the bucket it held, which the sequential protocol guarantees. Over HTTP a bucket is packed, then
sent as safetensors bytes (``encode_bucket_body``); the extra copy costs little next to HTTP.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import httpx
import torch

from posttrain.formats._buckets import (
    aligned,
    as_byte_tensor,
    bucket_layout,
    encode_bucket_body,
    expected_tensors,
    pack_bucket,
    plan_buckets,
)
from posttrain.formats._errors import FormatsConfigError
from posttrain.interface import (
    BucketManifest,
    EngineError,
    IncompleteUpdateError,
    ShmBucketRequest,
    StaleVersionError,
    WeightSink,
    WeightUpdateBegin,
    WeightUpdateResult,
)

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024


class ShmRing:
    """Two slots of ``slot_bytes`` in one ``/dev/shm`` file, mapped once; unlinked at close."""

    def __init__(self, slot_bytes: int, *, directory: str = "/dev/shm") -> None:
        self.slot_bytes = aligned(slot_bytes)
        stat = os.statvfs(directory)
        free = stat.f_bavail * stat.f_frsize
        if slot_bytes <= 0 or 2 * self.slot_bytes > free:
            raise FormatsConfigError(
                f"ShmRing: two slots of {self.slot_bytes} bytes do not fit the {free} bytes free "
                f"in {directory}"
            )
        self.path = Path(directory) / f"posttrain-wsync-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with open(self.path, "wb") as f:
            f.truncate(2 * self.slot_bytes)
        self._buf = torch.from_file(
            str(self.path), shared=True, size=2 * self.slot_bytes, dtype=torch.uint8
        )

    def slot(self, i: int) -> torch.Tensor:
        """A uint8 view of slot ``i`` (0 or 1)."""
        return self._buf[i * self.slot_bytes : (i + 1) * self.slot_bytes]

    def slot_holding(self, payload: torch.Tensor) -> int | None:
        """The slot whose memory ``payload`` starts at, if any (a bucket packed in place)."""
        for i in (0, 1):
            if payload.data_ptr() == self.slot(i).data_ptr():
                return i
        return None

    def close(self) -> None:
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WeightPushClient:
    """A synchronous wsync/1 client for one engine (a ``WeightSink``); the HTTP transport is
    injectable, the timeout finite. With ``ring`` set, buckets travel through shared memory."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        transport: httpx.BaseTransport | None = None,
        http: httpx.Client | None = None,
        ring: ShmRing | None = None,
    ) -> None:
        """``http`` replaces the whole client (e.g. Starlette's TestClient for in-process apps)."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.ring = ring
        self._http = http or httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport
        )
        if http is not None:
            self._http.headers.update(headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> WeightPushClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def post(self, path: str, **kwargs: Any) -> dict[str, Any]:
        """POST and decode; a non-200 reply raises a typed error naming the URL."""
        url = f"{self.base_url}{path}"
        try:
            r = self._http.post(path, **kwargs)
        except httpx.HTTPError as e:
            raise EngineError(f"{url}: {type(e).__name__}: {e}", url=url) from e
        try:
            body = r.json()
        except ValueError:
            body = {"message": r.text}
        if not isinstance(body, dict):
            body = {"message": body}
        if r.status_code != 200:
            message = str(body.get("error", body))
            if r.status_code == 409:
                raise StaleVersionError(f"{url}: {message}")
            if path == "/end_weight_update" and "missing" in body:
                raise IncompleteUpdateError(f"{url}: {body.get('message', message)}")
            raise EngineError(
                f"{url}: HTTP {r.status_code}: {message}", url=url, status=r.status_code
            )
        return body

    def begin(self, header: WeightUpdateBegin) -> None:
        """Open an update: its version, kind and every tensor it will send."""
        self.post("/begin_weight_update", json=header.to_dict())

    def send_bucket(
        self, manifest: BucketManifest, payload: bytes | bytearray | memoryview | torch.Tensor
    ) -> None:
        """Send one packed bucket: through the ring when one is set, else as safetensors bytes.

        A payload packed in place in a ring slot is sent from there; any other is copied into
        slot ``bucket_index % 2`` first.
        """
        self._send(manifest, payload, self.ring)

    def _send(
        self,
        manifest: BucketManifest,
        payload: bytes | bytearray | memoryview | torch.Tensor,
        ring: ShmRing | None,
    ) -> None:
        if ring is None:
            self.post(
                "/update_weights_from_safetensors",
                content=encode_bucket_body(manifest, payload),
                headers={"Content-Type": "application/octet-stream"},
            )
            return
        data = as_byte_tensor(payload)[: manifest.total_bytes]
        slot = ring.slot_holding(data) if data.numel() else None
        if slot is None:
            slot = manifest.bucket_index % 2
            if manifest.total_bytes > ring.slot_bytes:
                raise FormatsConfigError(
                    f"bucket {manifest.bucket_index} of {manifest.total_bytes} bytes does not fit "
                    f"a {ring.slot_bytes}-byte ring slot"
                )
            ring.slot(slot)[: manifest.total_bytes].copy_(data)
        request = ShmBucketRequest(
            manifest=manifest, shm_path=str(ring.path), slot=slot, slot_bytes=ring.slot_bytes
        )
        self.post("/update_weights_from_shm", json=request.to_dict())

    def bucket_buffer(self, bucket_index: int) -> torch.Tensor | None:
        """Where to pack bucket ``bucket_index`` so sending it copies nothing (a ring slot)."""
        return None if self.ring is None else self.ring.slot(bucket_index % 2)

    def end(self, update_id: str) -> WeightUpdateResult:
        """Close the update; success only if every expected tensor arrived exactly once."""
        return WeightUpdateResult.parse(
            self.post("/end_weight_update", json={"update_id": update_id})
        )

    def abort(self, update_id: str) -> None:
        """Abandon the update (the engine then refuses to generate until a full update)."""
        self.post("/abort_weight_update", json={"update_id": update_id})

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """SGLang's ``/release_memory_occupation`` (``tags``: ``weights``, ``kv_cache``; None =
        all): the engine drops its weights until ``resume_memory_occupation``."""
        return self.post("/release_memory_occupation", json={"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """SGLang's ``/resume_memory_occupation``. Resumed weights are not valid: push them all
        again (the frozen towers too: ``posttrain.models.has_towers``) before generating."""
        return self.post("/resume_memory_occupation", json={"tags": tags})


def push_weights(
    client: WeightSink,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    weight_version: int,
    transport: Literal["http", "shm"] = "http",
    kind: Literal["base", "lora"] = "base",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    lora_name: str | None = None,
    lora_config: Mapping[str, Any] | None = None,
    ring: ShmRing | None = None,
    with_sha256: bool = False,
    update_id: str | None = None,
) -> WeightUpdateResult:
    """Send a full update; returns the engine's result (success, or it raised).

    With ``transport="shm"`` the buckets go through ``ring`` (or the client's, or a ring of two
    slots sized to the largest bucket, made here and unlinked at the end). ``client`` may be any
    ``WeightSink``; one that is not a ``WeightPushClient`` gets each bucket's packed bytes.
    """
    if bucket_bytes <= 0:
        raise FormatsConfigError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    if transport == "shm" and not isinstance(client, WeightPushClient):
        raise FormatsConfigError(
            f"transport='shm' needs a WeightPushClient, got {type(client).__name__}"
        )
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    uid = update_id or uuid.uuid4().hex
    client.begin(
        WeightUpdateBegin(
            update_id=uid,
            weight_version=weight_version,
            kind=kind,
            expected=expected_tensors(items),
            lora_name=lora_name,
            lora_config=None if lora_name is None else dict(lora_config or {}),
        )
    )
    groups = plan_buckets(items, bucket_bytes)
    own_ring = None
    if transport == "shm":
        assert isinstance(client, WeightPushClient)  # checked before begin
        ring = ring or client.ring
        if ring is None:
            biggest = max([1, *(bucket_layout(g)[1] for g in groups)])
            ring = own_ring = ShmRing(biggest)
    else:
        ring = None
    try:
        for k, group in enumerate(groups):
            manifest, payload = pack_bucket(
                group,
                update_id=uid,
                weight_version=weight_version,
                kind=kind,
                bucket_index=k,
                is_last=k == len(groups) - 1,
                with_sha256=with_sha256,
                out=None if ring is None else ring.slot(k % 2),
            )
            if isinstance(client, WeightPushClient):
                client._send(manifest, payload, ring)  # the client's own ring is left as it was
            else:  # any other WeightSink: the bucket's packed bytes
                client.send_bucket(manifest, payload.numpy().data)
        return client.end(uid)
    finally:
        if own_ring is not None:
            own_ring.close()
