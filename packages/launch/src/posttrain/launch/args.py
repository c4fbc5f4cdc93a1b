"""An ordered flag multimap that renders to an argv list and remembers who set each flag.

Rules set flags with a ``source`` (the rule's name); a later rule that sets the same flag
replaces it and the replacement is remembered, so ``explain()`` can say which rule won.
User arguments are kept verbatim and always rendered *last*: the programs we launch parse
with argparse, where the last occurrence of a flag wins, so the user overrides any rule without
the launcher having to understand the flag. That is also the escape hatch for flags no rule
knows. Nothing here ever builds a shell string: ``argv()`` is a list, and tokens such as
``[0]*1+[1]*46`` travel intact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from posttrain.launch._errors import LaunchConfigError

USER = "user"


@dataclass(frozen=True, slots=True)
class Flag:
    """One flag with its values (empty for a switch) and the rule that set it."""

    name: str
    values: tuple[str, ...]
    source: str

    def tokens(self) -> list[str]:
        return [self.name, *self.values]


def _check_name(name: str) -> None:
    if not name.startswith("--") or len(name) < 3 or " " in name:
        raise LaunchConfigError(f"flag name {name!r} must look like --some-flag")


class Args:
    """Flags set by rules, in first-set order, followed by the user's tokens."""

    __slots__ = ("_flags", "_history", "_user")

    def __init__(self) -> None:
        self._flags: list[Flag] = []
        self._history: list[tuple[Flag, Flag]] = []  # (replaced, replacement)
        self._user: list[str] = []

    def set(self, name: str, *values: object, source: str) -> None:
        """Set a single-valued flag (or a switch); replaces an earlier setting in place."""
        _check_name(name)
        flag = Flag(name, tuple(str(v) for v in values), source)
        for i, old in enumerate(self._flags):
            if old.name == name:
                self._history.append((old, flag))
                self._flags[i] = flag
                self._flags = [f for j, f in enumerate(self._flags) if j <= i or f.name != name]
                return
        self._flags.append(flag)

    def add(self, name: str, *values: object, source: str) -> None:
        """Append a repeatable flag occurrence (``--lora-paths a=x --lora-paths b=y``)."""
        _check_name(name)
        self._flags.append(Flag(name, tuple(str(v) for v in values), source))

    def copy(self) -> Args:
        """An independent copy (flags, replacement history and user tokens)."""
        out = Args()
        out._flags = list(self._flags)
        out._history = list(self._history)
        out._user = list(self._user)
        return out

    def remove(self, name: str) -> None:
        self._flags = [f for f in self._flags if f.name != name]

    def get(self, name: str) -> tuple[str, ...] | None:
        """The values of the last rule-set occurrence of ``name`` (user tokens not included)."""
        found = [f for f in self._flags if f.name == name]
        return found[-1].values if found else None

    def __contains__(self, name: object) -> bool:
        return any(f.name == name for f in self._flags)

    def extend_user(self, tokens: Iterable[str]) -> None:
        """Append the user's tokens verbatim; they render after every rule-set flag."""
        self._user.extend(str(t) for t in tokens)

    @property
    def flags(self) -> tuple[Flag, ...]:
        return tuple(self._flags)

    @property
    def user_tokens(self) -> tuple[str, ...]:
        return tuple(self._user)

    def argv(self) -> list[str]:
        out: list[str] = []
        for flag in self._flags:
            out.extend(flag.tokens())
        out.extend(self._user)
        return out

    def user_flag_names(self) -> list[str]:
        """Flag names among the user's tokens (``--x`` and ``--x=v`` both count)."""
        return [t.split("=", 1)[0] for t in self._user if t.startswith("--")]

    def explain(self) -> list[str]:
        """One line per rule-set flag naming its rule, then what the user overrides or adds."""
        lines: list[str] = []
        overridden = set(self.user_flag_names())
        for old, new in self._history:
            lines.append(f"{new.name}: rule {new.source} replaced {_show(old)} (from {old.source})")
        for flag in self._flags:
            note = "  [overridden by user]" if flag.name in overridden else ""
            lines.append(f"{_show(flag)}  <- {flag.source}{note}")
        rule_names = {f.name for f in self._flags}
        for name in self.user_flag_names():
            verb = "overrides rule value" if name in rule_names else "adds"
            lines.append(f"{name}: user {verb} (user arguments come last; last one wins)")
        return lines


def _show(flag: Flag) -> str:
    return " ".join([flag.name, *flag.values])


def parse_assignments(items: Sequence[str], what: str) -> list[tuple[str, str]]:
    """Parse ``NAME=VALUE`` items (``--lora``, ``--env``); the error names the bad item."""
    pairs: list[tuple[str, str]] = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise LaunchConfigError(f"{what} {item!r} must be NAME=VALUE")
        pairs.append((name, value))
    return pairs
