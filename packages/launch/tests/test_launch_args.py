"""Args: the ordered flag multimap, its argv rendering and its explanation."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.launch import Args, LaunchConfigError
from posttrain.launch.args import parse_assignments


def test_set_replaces_in_place_and_remembers() -> None:
    a = Args()
    a.set("--tp-size", 1, source="base")
    a.set("--port", 30000, source="base")
    a.set("--tp-size", 2, source="glm")
    assert a.argv() == ["--tp-size", "2", "--port", "30000"]
    assert "--tp-size: rule glm replaced --tp-size 1 (from base)" in a.explain()


def test_add_repeats_and_switches_have_no_value() -> None:
    a = Args()
    a.set("--enable-lora", source="r")
    a.add("--lora-paths", "a=/x", source="r")
    a.add("--lora-paths", "b=/y", source="r")
    assert a.argv() == ["--enable-lora", "--lora-paths", "a=/x", "--lora-paths", "b=/y"]
    assert a.get("--lora-paths") == ("b=/y",)
    a.remove("--lora-paths")
    assert "--lora-paths" not in a


def test_bad_flag_names_are_rejected() -> None:
    for bad in ("tp-size", "-t", "--", "--a b"):
        with pytest.raises(LaunchConfigError, match="must look like --some-flag"):
            Args().set(bad, source="r")


def test_parse_assignments() -> None:
    assert parse_assignments(["a=/p=q"], "--lora") == [("a", "/p=q")]
    with pytest.raises(LaunchConfigError, match="--lora 'nope' must be NAME=VALUE"):
        parse_assignments(["nope"], "--lora")


@settings(max_examples=25, deadline=None)
@given(
    rule_flags=st.lists(st.sampled_from(["--a", "--b", "--c"]), max_size=6),
    user=st.lists(st.text(min_size=1, max_size=5), max_size=5),
)
def test_user_tokens_are_verbatim_suffix(rule_flags: list[str], user: list[str]) -> None:
    a = Args()
    for i, name in enumerate(rule_flags):
        a.set(name, i, source=f"rule{i}")
    a.extend_user(user)
    argv = a.argv()
    assert argv[len(argv) - len(user) :] == user
    # Each rule flag appears once, with the value of the last rule that set it.
    for name in set(rule_flags):
        last = max(i for i, n in enumerate(rule_flags) if n == name)
        assert argv[: len(argv) - len(user)].count(name) == 1
        assert a.get(name) == (str(last),)
