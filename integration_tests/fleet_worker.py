"""The trainer side of ``test_integration_engine_fleet``, importable so its rank is spawned.

``fleet_run`` runs in a fresh interpreter (``run_workers(..., start_method="spawn")``): the
tests before it in the suite can leave threads in pytest's process (after an in-process GRPO run
the sharded model's device meshes stay alive, and with them the default group's TCPStore and
gloo's loop threads), and a rank forked from that process hung there in CI. ``conftest.py`` puts this directory on ``sys.path``,
which spawn passes to the child.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx


class Recording(httpx.BaseTransport):
    """httpx's own transport, noting each weight-group request as ``(engine, route)``."""

    ROUTES = ("/init_weights_update_group", "/destroy_weights_update_group")

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.seen: list[tuple[str, str]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in self.ROUTES:
            self.seen.append((f"http://{request.url.host}:{request.url.port}", request.url.path))
        return self.inner.handle_request(request)

    def take(self) -> list[tuple[str, str]]:
        seen, self.seen = sorted(self.seen), []
        return seen


def fleet_run(rank: int, world: int, ckpt: str, a: str, b: str) -> dict[str, Any]:
    import torch

    from posttrain.formats import tensors_sha256
    from posttrain.fsdp_mesh import iter_full_state_dict
    from posttrain.grpo.config import GrpoConfig
    from posttrain.grpo.fleet import EngineFleet, SyncTarget
    from posttrain.grpo.trainer import build_policy
    from posttrain.models import to_hf_state_dict

    torch.set_num_threads(1)
    policy = build_policy(GrpoConfig(model_path=Path(ckpt), train="full", replicate=1, shard=1))
    wire = Recording()
    target = SyncTarget(engine_urls=(a, b), timeout_s=60.0, transport=wire)
    out: dict[str, Any] = {}

    def step(name: str, version: int) -> None:
        with torch.no_grad():
            for p in policy.model.parameters():
                p.add_(0.01)
        synced = fleet.sync(policy, version, when=name)
        sha = tensors_sha256(
            to_hf_state_dict(dict(iter_full_state_dict(policy.model)), policy.model.config)
        )
        served = {url: httpx.get(f"{url}/weights_checksum", timeout=30).json() for url in (a, b)}
        out[name] = {
            "routes": wire.take(), "live": fleet.engine_urls, "lost": fleet.lost,
            "readmitted": synced.readmitted, "sha": sha, "versions": dict(fleet.versions),
            "served": {u: (s["weight_version"], s["sha256"]) for u, s in served.items()},
        }  # fmt: skip

    with EngineFleet(target) as fleet:
        first = fleet.first_version()
        step("first", first)
        step("second", first + 1)
        fleet._set_aside(((b, "set aside by the test"),), "test")  # as if b had not answered
        fleet.readmit_lost = False  # not probed: it stays out
        step("without-b", first + 2)
        fleet.readmit_lost = True
        step("readmit-b", first + 3)  # b answers /health: re-admitted
    out["close"] = wire.take()
    out["first_version"] = first
    return out
