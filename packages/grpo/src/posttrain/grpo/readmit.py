"""Lost engines: kept out of rollouts while their weights are stale, brought back once current.

A weight sync that cannot reach an engine (``sync.SyncResult.lost``) leaves it on the weights
it last took. The loop then

* deregisters it from sgl-router (``deregister``: ``DELETE /workers/{id}`` through
  session-router's ``RouterHandle``), so no rollout turn reaches it, even when it wakes up and
  sgl-router's own health checks would find it healthy again;
* at every later sync, asks each lost engine for ``/health`` with a short, bounded timeout
  (``answering``); one that answers gets the trainer's current weights as an engine after an
  offload cycle does (``sync_weights(..., readmit=...)``: full weights with the frozen towers,
  or a base reload from the checkpoint plus the adapter), and only once that push succeeded is
  it registered with the router again (``register``) and counted back
  (``sync_engines_readmitted``).

Without a router URL there is nothing to deregister from: the loop still re-syncs an engine
that answers again, and in full-weight training it leaves out of the step every sample whose
engine weight version is behind the trainer's (``stale``; counted in ``stale_samples``). An
adapter push does not change an engine's weight version, so in LoRA training the router is
what keeps a stale engine out.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx

from posttrain.grpo._errors import GrpoRunError
from posttrain.interface import Sample
from posttrain.session_router import RouterHandle

PROBE_TIMEOUT_S = 2.0  # the most one lost engine's /health may take, per sync


def answering(
    urls: Sequence[str], *, timeout_s: float, transport: httpx.BaseTransport | None = None
) -> list[str]:
    """The engines of ``urls`` whose ``/health`` answers 200 within ``min(timeout_s,
    PROBE_TIMEOUT_S)``, in the order given; one request each, all at once (frozen engines cost
    that timeout once per sync, not once each)."""
    if not urls:
        return []
    limit = min(timeout_s, PROBE_TIMEOUT_S)

    def healthy(client: httpx.Client, url: str) -> bool:
        try:
            return client.get(f"{url.rstrip('/')}/health").status_code == 200
        except httpx.HTTPError:
            return False

    with (
        httpx.Client(timeout=limit, transport=transport) as client,
        ThreadPoolExecutor(max_workers=min(len(urls), 16)) as pool,
    ):
        ok = list(pool.map(lambda url: healthy(client, url), urls))
    return [url for url, up in zip(urls, ok, strict=True) if up]


def deregister(router_url: str, url: str, *, timeout_s: float) -> None:
    """Remove engine ``url`` from the sgl-router at ``router_url`` (nothing to do when it is
    not registered); a router that fails is a ``GrpoRunError`` naming both."""
    with RouterHandle(router_url, timeout_s=timeout_s) as router:
        try:
            if url.rstrip("/") in router.workers():
                router.remove_worker(url, timeout_s=timeout_s)
        except Exception as exc:  # RouterStartError, httpx errors: the router failed
            raise GrpoRunError(
                f"deregistering lost engine {url} from router {router_url}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc


def register(router_url: str, url: str, *, timeout_s: float) -> None:
    """Register engine ``url`` with the sgl-router at ``router_url`` again and wait until the
    router lists it healthy; a router that fails is a ``GrpoRunError`` naming both."""
    with RouterHandle(router_url, timeout_s=timeout_s) as router:
        try:
            if url.rstrip("/") not in router.workers():
                router.add_worker(url, timeout_s=timeout_s)
        except Exception as exc:  # RouterStartError, httpx errors: the router failed
            raise GrpoRunError(
                f"registering re-admitted engine {url} with router {router_url}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc


def turn_versions(sample: Sample) -> list[int | None]:
    """The engine weight version of each turn of ``sample`` (the session router's
    ``weight_versions``), or the sample's own when it has no per-turn list."""
    per_turn = sample.metadata.get("weight_versions")
    if isinstance(per_turn, list) and per_turn:
        return [v if isinstance(v, int) else None for v in per_turn]
    return [sample.weight_version]


def is_stale(sample: Sample, version: int) -> bool:
    """Whether an engine at another weight version than ``version`` produced a turn of
    ``sample`` (sampled from weights the trainer no longer holds); a turn with no reported
    version counts as current."""
    return any(v is not None and v != version for v in turn_versions(sample))
