"""``AdapterClient``: push LoRA adapters to an SGLang-compatible engine over HTTP.

Routes (SGLang's): ``POST /load_lora_adapter {lora_name, lora_path, pinned}``,
``POST /load_lora_adapter_from_tensors {lora_name, config_dict, serialized_named_tensors,
pinned, expected_checksums?}`` (SGLang's ``LoadLoRAAdapterFromTensorsReqInput``: one serialized
copy per TP rank, ``tp_size`` of them), ``POST /unload_lora_adapter {lora_name}``; replies
``{success, error_message, loaded_adapters}`` (HTTP 400 on failure). Capabilities come from
``GET /server_info`` (``enable_lora`` / ``lora_paths``, ``max_lora_rank``) plus an optional
``lora_capabilities`` list that posttrain's local engine reports: ``"checksums"`` (it verifies
``expected_checksums``) and ``"replace"`` (a load under a loaded name replaces that adapter
atomically). Replacing an adapter is one load where the engine says ``"replace"``, else unload
then load (SGLang's body has no upsert and refuses a loaded name).

Departures: ``unload`` ignores only a "not loaded" / "not found" refusal (swallowing every
error hides real failures); checksums are sha256 of each tensor's raw bytes, sent as
``expected_checksums`` and compared against any the engine echoes. The tensors travel by value
(a pickle of CPU tensors, which SGLang's safe unpickler and posttrain's restricted one read),
so the push needs no shared disk or GPU.

The body and the checksums (``adapter_push_body``, ``tensor_sha256``) live in
``posttrain.formats``, which the engine decodes with too.

The per-request LoRA fields (``LoraServing``, ``serves_lora``, ``request_fields``) live in
``posttrain.formats``, their one home shared with the session router; ``posttrain.lora``
re-exports them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from posttrain.formats import adapter_push_body, tensor_sha256
from posttrain.interface import TransportError
from posttrain.lora._errors import AdapterPushError, ChecksumMismatchError

_NOT_LOADED = ("not loaded", "not found", "does not exist", "no lora adapter")


@dataclass(kw_only=True, slots=True, frozen=True)
class AdapterCapabilities:
    """What an engine's LoRA support can do (probed once per client)."""

    lora_enabled: bool
    max_lora_rank: int | None
    checksums: bool
    replace: bool = False  # a load under a loaded name replaces it (no unload needed)


class AdapterClient:
    """Load, replace and unload LoRA adapters on one engine; every timeout finite by default."""

    def __init__(
        self,
        base_url: str,
        *,
        transport: httpx.BaseTransport | None = None,
        timeout: float = 60.0,
        api_key: str | None = None,
        tp_size: int = 1,
        http: httpx.Client | None = None,
    ) -> None:
        """``tp_size``: the engine's tensor-parallel size (one serialized copy per rank).
        ``http``: an HTTP client to the engine to borrow (its base URL ``base_url``, its
        headers and timeout already set; the caller closes it) instead of opening one."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.tp_size = tp_size
        self._caps: AdapterCapabilities | None = None
        self._owned = http is None
        self._http = http or httpx.Client(
            base_url=self.base_url, transport=transport, timeout=timeout, headers=headers
        )

    def close(self) -> None:
        """Close the underlying HTTP client (unless borrowed)."""
        if self._owned:
            self._http.close()

    def __enter__(self) -> AdapterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> httpx.Response:
        url = f"{self.base_url}{path}"
        try:
            return self._http.request(method, path, json=body)
        except httpx.TimeoutException as exc:
            raise TransportError(f"{method} {url} timed out: {exc}", url=url) from exc
        except httpx.HTTPError as exc:
            raise TransportError(f"{method} {url} failed: {exc}", url=url) from exc

    def _post(self, path: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        url = f"{self.base_url}{path}"
        resp = self._request("POST", path, body)
        try:
            data = resp.json()
        except ValueError:
            data = {"success": False, "error_message": resp.text[:500]}
        if not isinstance(data, dict):
            raise TransportError(f"POST {url}: reply is not a JSON object", url=url)
        if resp.status_code >= 400 or data.get("success") is False:
            message = str(data.get("error_message") or data.get("message") or resp.text[:500])
            cls = ChecksumMismatchError if "checksum" in message.lower() else AdapterPushError
            raise cls(
                f"{what} refused by {url} (HTTP {resp.status_code}): {message}",
                url=url,
                status=resp.status_code,
            )
        return data

    def capabilities(self, *, refresh: bool = False) -> AdapterCapabilities:
        """Probe ``/server_info`` (or ``/get_server_info``) once; cached."""
        if self._caps is not None and not refresh:
            return self._caps
        resp = self._request("GET", "/server_info")
        if resp.status_code == 404:
            resp = self._request("GET", "/get_server_info")
        url = str(resp.request.url)
        if resp.status_code != 200:
            raise AdapterPushError(
                f"GET {url}: HTTP {resp.status_code}", url=url, status=resp.status_code
            )
        try:
            info = resp.json()
        except ValueError as exc:
            raise TransportError(f"GET {url}: reply is not JSON", url=url) from exc
        extra = set(info.get("lora_capabilities") or [])
        rank = info.get("max_lora_rank")
        self._caps = AdapterCapabilities(
            lora_enabled=bool(info.get("enable_lora") or info.get("lora_paths")),
            max_lora_rank=int(rank) if rank is not None else None,
            checksums="checksums" in extra,
            replace="replace" in extra,
        )
        return self._caps

    def _require_lora(self, r: int | None = None) -> AdapterCapabilities:
        caps = self.capabilities()
        if not caps.lora_enabled:
            raise AdapterPushError(
                f"{self.base_url}: engine does not serve LoRA (enable_lora off)", url=self.base_url
            )
        if r is not None and caps.max_lora_rank is not None and r > caps.max_lora_rank:
            raise AdapterPushError(
                f"{self.base_url}: adapter rank {r} exceeds the engine's max_lora_rank "
                f"{caps.max_lora_rank}",
                url=self.base_url,
            )
        return caps

    def load_from_path(self, name: str, path: str, *, pinned: bool = False) -> dict[str, Any]:
        """Load a PEFT directory the engine can read from disk."""
        self._require_lora()
        body = {"lora_name": name, "lora_path": path, "pinned": pinned}
        return self._post("/load_lora_adapter", body, f"load adapter {name!r} from {path}")

    def load_from_tensors(
        self,
        name: str,
        tensors: Mapping[str, torch.Tensor],
        config_dict: Mapping[str, Any],
        *,
        pinned: bool = False,
    ) -> dict[str, Any]:
        """Send an adapter's tensors; with checksum support the engine verifies every tensor."""
        caps = self._require_lora(int(config_dict.get("r", 0)) or None)
        ours = {k: tensor_sha256(v) for k, v in tensors.items()} if caps.checksums else {}
        body = adapter_push_body(
            name,
            config_dict,
            tensors,
            tp_size=self.tp_size,
            expected_checksums=ours,
            pinned=pinned,
        ).to_dict()
        reply = self._post("/load_lora_adapter_from_tensors", body, f"load adapter {name!r}")
        theirs = reply.get("checksums")
        if isinstance(theirs, dict):  # an engine that echoes what it stored: compare always
            ours = ours or {k: tensor_sha256(v) for k, v in tensors.items()}
            bad = sorted(k for k in ours if theirs.get(k) != ours[k])
            if bad:
                raise ChecksumMismatchError(
                    f"{self.base_url}: adapter {name!r}: checksum of {bad[0]} differs "
                    f"({len(bad)} tensors)",
                    url=self.base_url,
                )
        return reply

    def unload(self, name: str) -> bool:
        """Unload ``name``; False if it was not loaded, raises on any other refusal."""
        try:
            self._post("/unload_lora_adapter", {"lora_name": name}, f"unload adapter {name!r}")
        except AdapterPushError as exc:
            if any(s in str(exc).lower() for s in _NOT_LOADED):
                return False
            raise
        return True

    def push(
        self, name: str, tensors: Mapping[str, torch.Tensor], config_dict: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Replace the engine's adapter ``name``: one load where the engine replaces a loaded
        name itself (``"replace"``), else unload (ignoring "not loaded"), then load."""
        if not self._require_lora().replace:
            self.unload(name)
        return self.load_from_tensors(name, tensors, config_dict)
