"""Plan: validation, placeholders, JSON round trip."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.launch import LaunchConfigError, Plan, ProcessSpec, Readiness, Registration, Role
from posttrain.launch.plan import resolve, resolve_process


def spec(name: str = "p", node: int = 0, argv: tuple[str, ...] = ("python", "-V")) -> ProcessSpec:
    return ProcessSpec(name=name, role=Role.ENGINE, argv=argv, node=node)


def test_plan_rejects_duplicates_empty_argv_and_bad_nodes() -> None:
    with pytest.raises(LaunchConfigError, match=r"duplicate process names \['a'\]"):
        Plan(name="x", hardware="h200", nodes=1, processes=(spec("a"), spec("a")))
    with pytest.raises(LaunchConfigError, match="process 'a' of plan 'x' has no argv"):
        Plan(name="x", hardware="h200", nodes=1, processes=(spec("a", argv=()),))
    with pytest.raises(LaunchConfigError, match="on node 2 but plan 'x' has 2 node"):
        Plan(name="x", hardware="h200", nodes=2, processes=(spec("a", node=2),))


def test_placeholders_resolve_per_node_and_name_missing_nodes() -> None:
    ips = {0: "10.0.0.1", 1: "10.0.0.2"}
    assert resolve("{node_ip}:1/{node_ip:0}", 1, ips) == "10.0.0.2:1/10.0.0.1"
    with pytest.raises(LaunchConfigError, match=r"\{node_ip:3\} names node 3"):
        resolve("{node_ip:3}", 0, ips)
    p = ProcessSpec(
        name="e", role=Role.ENGINE, argv=("python", "--host", "{node_ip}"), node=1,
        env={"X": "{node_ip:0}"},
        readiness=Readiness(url="http://{node_ip}:1/health", timeout_s=1),
    )  # fmt: skip
    argv, env, url = resolve_process(p, ips, "/usr/bin/python3")
    assert argv == ["/usr/bin/python3", "--host", "10.0.0.2"]
    assert env == {"X": "10.0.0.1"}
    assert url == "http://10.0.0.2:1/health"


text = st.text(alphabet="ab{}:_ -[]*+=01", max_size=12)


@settings(max_examples=25, deadline=None)
@given(
    argvs=st.lists(st.lists(text, min_size=1, max_size=4), min_size=1, max_size=4),
    env=st.dictionaries(st.sampled_from(["A", "B_C"]), text, max_size=2),
    stage=st.integers(0, 3),
)
def test_json_round_trip(argvs: list[list[str]], env: dict[str, str], stage: int) -> None:
    plan = Plan(
        name="rt",
        hardware="cpu",
        nodes=1,
        processes=tuple(
            ProcessSpec(name=f"p{i}", role=Role.TRAINER, argv=tuple(a), env=env, stage=stage)
            for i, a in enumerate(argvs)
        ),
        registrations=(Registration(router="http://r", worker="http://w", after_stage=stage),),
        notes=("n",),
    )
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.stages == [list(plan.processes)]
