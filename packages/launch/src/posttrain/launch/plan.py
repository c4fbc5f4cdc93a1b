"""A launch plan: every process as an argv list, its environment, node, stage and readiness.

A plan is data, not behaviour: runners (dry run, local, Ray) execute it, golden tests compare
its JSON. Two departures from "a list of commands":

* Placeholders. A plan is made before anyone knows node addresses, so argv, env and readiness
  URLs may contain ``{node_ip}`` (the address of the node the process runs on) and
  ``{node_ip:K}`` (the address of plan node K, e.g. the torchrun rendezvous host). The token
  ``python`` as ``argv[0]`` means "the interpreter of the runner" on that node. Runners resolve
  both (``resolve``); goldens stay machine-independent.
* Stages. Processes of one stage are all spawned before any is awaited (engines load in
  parallel); the next stage starts when every process of this one answers its readiness URL.
* Registrations. Engines join the sgl-router through its worker API after a given stage,
  not through ``--worker-urls`` at router start (see ``Registration``).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from posttrain.launch._errors import LaunchConfigError

PYTHON = "python"
_PLACEHOLDER = re.compile(r"\{node_ip(?::(\d+))?\}")


class Role(StrEnum):
    PREPARE = "prepare"
    ENGINE = "engine"
    ROUTER = "router"
    SESSION_ROUTER = "session_router"
    TRAINER = "trainer"


@dataclass(frozen=True, slots=True, kw_only=True)
class Readiness:
    """The process is ready when ``GET url`` answers 200 within ``timeout_s``."""

    url: str
    timeout_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Registration:
    """Once stage ``after_stage`` is ready, register ``worker`` with the sgl-router ``router``.

    The router starts with no workers on purpose: the session router's start-up probe routes
    through it to a loopback echo worker and must be the only worker then. Engines join after.
    """

    router: str
    worker: str
    after_stage: int
    timeout_s: float = 120.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "router": self.router,
            "worker": self.worker,
            "after_stage": self.after_stage,
            "timeout_s": self.timeout_s,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessSpec:
    """One process of a plan. ``explain`` says which rule set each flag and what users won."""

    name: str
    role: Role
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    node: int = 0
    gpus: int = 0
    stage: int = 0
    readiness: Readiness | None = None
    explain: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "role": self.role.value,
            "node": self.node,
            "gpus": self.gpus,
            "stage": self.stage,
            "argv": list(self.argv),
            "env": dict(sorted(self.env.items())),
            "readiness": (
                None
                if self.readiness is None
                else {"url": self.readiness.url, "timeout_s": self.readiness.timeout_s}
            ),
            "explain": list(self.explain),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProcessSpec:
        ready = data.get("readiness")
        return cls(
            name=str(data["name"]),
            role=Role(data["role"]),
            argv=tuple(str(a) for a in data["argv"]),
            env={str(k): str(v) for k, v in data.get("env", {}).items()},
            node=int(data.get("node", 0)),
            gpus=int(data.get("gpus", 0)),
            stage=int(data.get("stage", 0)),
            readiness=None
            if ready is None
            else Readiness(url=str(ready["url"]), timeout_s=float(ready["timeout_s"])),
            explain=tuple(str(x) for x in data.get("explain", ())),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Processes to start, in stages, across ``nodes`` nodes of ``hardware``."""

    name: str
    hardware: str
    nodes: int
    processes: tuple[ProcessSpec, ...]
    registrations: tuple[Registration, ...] = ()
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = [p.name for p in self.processes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise LaunchConfigError(f"plan {self.name!r} has duplicate process names {dupes}")
        for p in self.processes:
            if not p.argv:
                raise LaunchConfigError(f"process {p.name!r} of plan {self.name!r} has no argv")
            if not 0 <= p.node < max(self.nodes, 1):
                raise LaunchConfigError(
                    f"process {p.name!r} is on node {p.node} but plan {self.name!r} "
                    f"has {self.nodes} node(s)"
                )

    @property
    def stages(self) -> list[list[ProcessSpec]]:
        ordered = sorted({p.stage for p in self.processes})
        return [[p for p in self.processes if p.stage == s] for s in ordered]

    def by_role(self, role: Role) -> list[ProcessSpec]:
        return [p for p in self.processes if p.role is role]

    def process(self, name: str) -> ProcessSpec:
        for p in self.processes:
            if p.name == name:
                return p
        raise LaunchConfigError(f"plan {self.name!r} has no process {name!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "hardware": self.hardware,
            "nodes": self.nodes,
            "notes": list(self.notes),
            "processes": [p.to_dict() for p in self.processes],
            "registrations": [r.to_dict() for r in self.registrations],
        }

    def to_json(self) -> str:
        """Deterministic JSON (stable key order, 2-space indent, trailing newline)."""
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan ``to_json`` wrote; anything else raises ``LaunchConfigError`` naming what
        is missing or malformed (a field name, or the JSON error and its line)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise LaunchConfigError(f"not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise LaunchConfigError(f"a plan is a JSON object, got {type(data).__name__}")
        try:
            return cls._from_dict(data)
        except KeyError as exc:
            raise LaunchConfigError(f"missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise LaunchConfigError(f"malformed field: {exc}") from None

    @classmethod
    def _from_dict(cls, data: Mapping[str, Any]) -> Plan:
        return cls(
            name=str(data["name"]),
            hardware=str(data["hardware"]),
            nodes=int(data["nodes"]),
            processes=tuple(ProcessSpec.from_dict(p) for p in data["processes"]),
            registrations=tuple(
                Registration(
                    router=str(r["router"]),
                    worker=str(r["worker"]),
                    after_stage=int(r["after_stage"]),
                    timeout_s=float(r["timeout_s"]),
                )
                for r in data.get("registrations", ())
            ),
            notes=tuple(str(n) for n in data.get("notes", ())),
        )

    def explain(self) -> str:
        """Which rule set each flag of each process, and which user overrides won."""
        lines = [f"plan {self.name} ({self.nodes} x {self.hardware})"]
        lines.extend(f"  note: {n}" for n in self.notes)
        for p in self.processes:
            lines.append(f"{p.name} [{p.role.value}, node {p.node}, stage {p.stage}]")
            lines.extend(f"    {line}" for line in p.explain)
        for r in self.registrations:
            lines.append(f"after stage {r.after_stage}: register {r.worker} with {r.router}")
        return "\n".join(lines) + "\n"

    def to_shell(self) -> str:
        """A human-readable rendering (shlex-quoted); runners never execute this string."""
        out = []
        for p in self.processes:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(p.env.items()))
            cmd = shlex.join(p.argv)
            out.append(
                f"# {p.name} (node {p.node}, stage {p.stage})\n{env + ' ' if env else ''}{cmd}"
            )
        for r in self.registrations:
            out.append(f"# after stage {r.after_stage}: POST {r.router}/workers url={r.worker}")
        return "\n".join(out) + "\n"


def resolve(text: str, node: int, node_ips: Mapping[int, str]) -> str:
    """Replace ``{node_ip}`` (this node) and ``{node_ip:K}`` (node K) with addresses."""

    def sub(match: re.Match[str]) -> str:
        key = node if match.group(1) is None else int(match.group(1))
        try:
            return node_ips[key]
        except KeyError:
            raise LaunchConfigError(
                f"placeholder {match.group(0)} names node {key}, which has no address"
            ) from None

    return _PLACEHOLDER.sub(sub, text)


def resolve_process(
    spec: ProcessSpec, node_ips: Mapping[int, str], python: str
) -> tuple[list[str], dict[str, str], str | None]:
    """The concrete argv, env and readiness URL of ``spec`` on its node."""
    argv = [resolve(a, spec.node, node_ips) for a in spec.argv]
    if argv[0] == PYTHON:
        argv[0] = python
    env = {k: resolve(v, spec.node, node_ips) for k, v in spec.env.items()}
    url = None if spec.readiness is None else resolve(spec.readiness.url, spec.node, node_ips)
    return argv, env, url
