"""The trainer side of wsync/1 against this engine: bucketing, HTTP and shared memory.

``push_weights`` packs named tensors greedily, in order, into buckets of at most
``bucket_bytes`` (aligned offsets, so mixed dtypes share a bucket), opens the
update with the full expected list, sends each bucket over the chosen transport
and ends the update; any non-200 reply raises (an incomplete update as
IncompleteUpdateError, a stale version as StaleVersionError). A tensor larger
than the cap travels alone in its own bucket.

The shared-memory transport is a two-slot ring in one file under ``/dev/shm``,
mapped once: bucket k is packed straight into slot ``k % 2`` (one copy), and a
slot is reused only after the engine's reply for the bucket it held, which the
sequential protocol guarantees.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import httpx
import torch
from safetensors.torch import save as st_save

from posttrain.interface import (
    BucketManifest,
    ConfigError,
    EngineError,
    IncompleteUpdateError,
    StaleVersionError,
    WeightUpdateResult,
)
from posttrain.local_engine._buckets import dtype_name, pack_bucket

__all__ = ["ShmRing", "WeightPushClient", "push_weights"]


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


class WeightPushClient:
    """A small synchronous client for the engine's update routes."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        transport: httpx.BaseTransport | None = None,
        http: httpx.Client | None = None,
    ) -> None:
        """``http`` replaces the whole client (e.g. Starlette's TestClient for in-process apps)."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
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
        body: dict[str, Any]
        try:
            body = r.json()
        except ValueError:
            body = {"message": r.text}
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

    def begin(
        self,
        *,
        update_id: str,
        weight_version: int,
        kind: Literal["base", "lora"],
        expected: Iterable[tuple[str, torch.Tensor]],
        lora_name: str | None = None,
        lora_config: Mapping[str, Any] | None = None,
    ) -> None:
        body: dict[str, Any] = {
            "update_id": update_id,
            "weight_version": weight_version,
            "kind": kind,
            "expected": [
                {"name": n, "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
                for n, t in expected
            ],
        }
        if lora_name is not None:
            body["lora_name"] = lora_name
            body["lora_config"] = dict(lora_config or {})
        self.post("/begin_weight_update", json=body)

    def send_safetensors(
        self, manifest: BucketManifest, tensors: Mapping[str, torch.Tensor]
    ) -> None:
        data = st_save(
            {n: t.detach().contiguous() for n, t in tensors.items()},
            metadata={"manifest": manifest.to_json()},
        )
        self.post(
            "/update_weights_from_safetensors",
            content=data,
            headers={"Content-Type": "application/octet-stream"},
        )

    def send_shm(self, manifest: BucketManifest, ring: ShmRing, slot: int) -> None:
        self.post(
            "/update_weights_from_shm",
            json={
                "manifest": manifest.to_dict(),
                "shm_path": str(ring.path),
                "slot": slot,
                "slot_bytes": ring.slot_bytes,
            },
        )

    def end(self, update_id: str) -> WeightUpdateResult:
        return WeightUpdateResult.parse(
            self.post("/end_weight_update", json={"update_id": update_id})
        )

    def abort(self, update_id: str) -> None:
        self.post("/abort_weight_update", json={"update_id": update_id})


class ShmRing:
    """Two slots of ``slot_bytes`` in one ``/dev/shm`` file, mapped once; unlinked at close."""

    def __init__(self, slot_bytes: int, *, directory: str = "/dev/shm") -> None:
        self.slot_bytes = _align(slot_bytes)
        stat = os.statvfs(directory)
        free = stat.f_bavail * stat.f_frsize
        if slot_bytes <= 0 or 2 * self.slot_bytes > free:
            raise ConfigError(
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
        return self._buf[i * self.slot_bytes : (i + 1) * self.slot_bytes]

    def close(self) -> None:
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _buckets(
    tensors: list[tuple[str, torch.Tensor]], cap: int, alignment: int
) -> list[list[tuple[str, torch.Tensor]]]:
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    used = 0
    for name, t in tensors:
        size = t.numel() * t.element_size()
        start = _align(used, alignment)
        if out[-1] and start + size > cap:
            out.append([])
            start = 0
        out[-1].append((name, t))
        used = start + size
    return [b for b in out if b]


def push_weights(
    client: WeightPushClient,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    weight_version: int,
    transport: Literal["http", "shm"] = "http",
    kind: Literal["base", "lora"] = "base",
    bucket_bytes: int = 64 * 1024 * 1024,
    lora_name: str | None = None,
    lora_config: Mapping[str, Any] | None = None,
    ring: ShmRing | None = None,
    with_sha256: bool = False,
    update_id: str | None = None,
) -> WeightUpdateResult:
    """Send a full update; returns the engine's result (success, or it raised)."""
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    uid = update_id or uuid.uuid4().hex
    client.begin(
        update_id=uid,
        weight_version=weight_version,
        kind=kind,
        expected=items,
        lora_name=lora_name,
        lora_config=lora_config,
    )
    groups = _buckets(items, bucket_bytes, 256)
    own_ring = None
    if transport == "shm" and ring is None:
        biggest = max(sum(_align(t.numel() * t.element_size()) for _, t in g) for g in groups)
        ring = own_ring = ShmRing(biggest)
    try:
        for k, group in enumerate(groups):
            common = {
                "update_id": uid,
                "weight_version": weight_version,
                "kind": kind,
                "bucket_index": k,
                "is_last": k == len(groups) - 1,
            }
            if transport == "shm":
                assert ring is not None
                manifest, _ = pack_bucket(
                    group,
                    out=ring.slot(k % 2),
                    with_sha256=with_sha256,
                    **common,  # type: ignore[arg-type]
                )
                client.send_shm(manifest, ring, k % 2)
            else:
                manifest, _ = (
                    pack_bucket(group, with_sha256=True, **common)  # type: ignore[arg-type]
                    if with_sha256
                    else _manifest_only(group, **common)
                )
                client.send_safetensors(manifest, dict(group))
        return client.end(uid)
    finally:
        if own_ring is not None:
            own_ring.close()


def _manifest_only(
    group: list[tuple[str, torch.Tensor]], **common: Any
) -> tuple[BucketManifest, None]:
    """A manifest with the flat layout's offsets, without packing any bytes."""
    entries = []
    offset = 0
    for name, t in group:
        offset = _align(offset)
        nbytes = t.numel() * t.element_size()
        entries.append(
            {
                "name": name,
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "offset": offset,
                "nbytes": nbytes,
            }
        )
        offset += nbytes
    return BucketManifest.parse({**common, "total_bytes": offset, "tensors": entries}), None
