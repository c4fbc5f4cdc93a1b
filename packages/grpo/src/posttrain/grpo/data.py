"""Prompt datasets from files: ``--prompt-data`` (and ``--eval-data``) into ``Prompt``s.

Formats, by what the path is:

* ``*.jsonl``: one JSON object per line (blank lines skipped);
* ``*.json``: a list of objects (or ``{"data": [...]}``);
* ``*.parquet``: read with pyarrow;
* a directory written by Hugging Face ``datasets`` ``save_to_disk``: its ``state.json`` lists the
  Arrow stream files (read with pyarrow; ``datasets`` is not needed); a ``DatasetDict``
  directory (``dataset_dict.json``) reads its ``train`` split, or ``DIR/SPLIT`` names another;
* any other directory: every ``*.jsonl``, ``*.json`` and ``*.parquet`` file in it, sorted by name.

Each row is an object. ``--input-key`` holds the prompt: a string, or a list of chat messages
(``{"role", "content"}``). ``--label-key`` holds the label the reward compares with (optional:
a row without it has label None only when the key is not asked for), ``--metadata-key`` an
object handed to the reward. With ``--apply-chat-template`` (the default) a string prompt becomes
one user message (after a ``--system-prompt`` system message, when given) and the session router
renders the model's chat template; with ``--no-apply-chat-template`` the prompt is raw text
(``--system-prompt`` is prepended, followed by a newline), sent as-is to a base model.

``fingerprint`` hashes the prompts a run draws from (their text, label and metadata); a
checkpoint stores it, and ``--resume`` refuses data that changed.

Every error is a ``GrpoConfigError`` naming the flag, the file and the row.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.grpo._errors import GrpoConfigError
from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.rewards import Prompt, Task, build_task
from posttrain.grpo.scoring import Scorer

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def read_rows(path: Path | str, *, flag: str = "--prompt-data") -> list[dict[str, Any]]:
    """The rows of the dataset at ``path`` (see the module docstring); refuses an empty one."""
    p = Path(path).expanduser()
    if not p.exists():
        split = p.parent / "dataset_dict.json"
        if split.is_file():
            raise GrpoConfigError(f"{flag} {path}: the dataset has no split {p.name!r}")
        raise GrpoConfigError(f"{flag} {path}: no such file or directory")
    rows = _read_dir(p, flag) if p.is_dir() else _read_file(p, flag)
    if not rows:
        raise GrpoConfigError(f"{flag} {path}: the dataset is empty (no rows)")
    return rows


def _read_dir(p: Path, flag: str) -> list[dict[str, Any]]:
    if (p / "dataset_dict.json").is_file():
        splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise GrpoConfigError(
                f"{flag} {p}: a DatasetDict without a train split; name one: "
                + ", ".join(f"{p}/{s}" for s in splits)
            )
        return _read_dir(p / "train", flag)
    if (p / "state.json").is_file():
        return _read_hf_saved(p, flag)
    files = sorted(f for f in p.iterdir() if f.suffix in DATA_SUFFIXES and f.is_file())
    if not files:
        raise GrpoConfigError(
            f"{flag} {p}: a directory with no {', '.join(DATA_SUFFIXES)} files and no "
            "datasets save_to_disk state.json"
        )
    return [row for f in files for row in _read_file(f, flag)]


def _read_hf_saved(p: Path, flag: str) -> list[dict[str, Any]]:
    import pyarrow as pa

    try:
        state = json.loads((p / "state.json").read_text())
        names = [str(entry["filename"]) for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GrpoConfigError(
            f"{flag} {p}: state.json does not list the dataset's files: {exc}"
        ) from exc
    rows: list[dict[str, Any]] = []
    for name in names:
        try:
            with pa.memory_map(str(p / name)) as source:
                table = pa.ipc.open_stream(source).read_all()
        except (OSError, pa.ArrowInvalid) as exc:
            raise GrpoConfigError(f"{flag} {p / name}: not an Arrow stream: {exc}") from exc
        rows.extend(table.to_pylist())
    return rows


def _read_file(p: Path, flag: str) -> list[dict[str, Any]]:
    if p.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(p).to_pylist()
        except (OSError, pa.ArrowException) as exc:
            raise GrpoConfigError(f"{flag} {p}: not a readable parquet file: {exc}") from exc
        return [_object(row, p, k + 1, flag, "row") for k, row in enumerate(rows)]
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise GrpoConfigError(f"{flag} {p}: cannot be read: {exc}") from exc
    if p.suffix == ".jsonl":
        out = []
        for line_no, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise GrpoConfigError(f"{flag} {p} line {line_no}: not JSON: {exc}") from exc
            out.append(_object(value, p, line_no, flag, "line"))
        return out
    if p.suffix == ".json":
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GrpoConfigError(f"{flag} {p}: not JSON: {exc}") from exc
        if isinstance(value, dict) and isinstance(value.get("data"), list):
            value = value["data"]
        if not isinstance(value, list):
            raise GrpoConfigError(
                f'{flag} {p}: expected a JSON list of objects (or {{"data": [...]}}), got '
                f"{type(value).__name__}"
            )
        return [_object(row, p, k + 1, flag, "row") for k, row in enumerate(value)]
    raise GrpoConfigError(
        f"{flag} {p}: unknown format {p.suffix or '(no suffix)'!r}; use "
        f"{', '.join(DATA_SUFFIXES)} or a datasets save_to_disk directory"
    )


def _object(value: Any, p: Path, where: int, flag: str, unit: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise GrpoConfigError(
            f"{flag} {p} {unit} {where}: expected an object, got {type(value).__name__}"
        )
    return value


def build_prompts(
    rows: Sequence[Mapping[str, Any]],
    *,
    input_key: str,
    label_key: str | None,
    metadata_key: str | None = None,
    apply_chat_template: bool = True,
    system_prompt: str | None = None,
    source: str = "--prompt-data",
) -> tuple[Prompt, ...]:
    """One ``Prompt`` per row; a missing or malformed key names the row and the keys it has."""
    prompts: list[Prompt] = []
    for k, row in enumerate(rows):
        where = f"{source} row {k + 1}"
        if input_key not in row:
            raise GrpoConfigError(
                f"{where}: no input key {input_key!r} (--input-key); the row has "
                f"{', '.join(map(repr, row)) or 'no keys'}"
            )
        if label_key is not None and label_key not in row:
            raise GrpoConfigError(
                f"{where}: no label key {label_key!r} (--label-key); the row has "
                f"{', '.join(map(repr, row)) or 'no keys'}"
            )
        row_meta: dict[str, Any] = {}
        if metadata_key is not None:
            if metadata_key not in row:
                raise GrpoConfigError(
                    f"{where}: no metadata key {metadata_key!r} (--metadata-key); the row has "
                    f"{', '.join(map(repr, row)) or 'no keys'}"
                )
            value = row[metadata_key]
            if value is not None and not isinstance(value, Mapping):
                raise GrpoConfigError(
                    f"{where}: {metadata_key!r} (--metadata-key) is a {type(value).__name__}, "
                    "not an object"
                )
            row_meta = dict(value or {})
        messages, text = _prompt_of(
            row[input_key], where, input_key, apply_chat_template, system_prompt
        )
        prompts.append(
            Prompt(
                index=k, messages=messages, text=text,
                label=row[label_key] if label_key is not None else None,
                row_metadata=row_meta,
            )
        )  # fmt: skip
    return tuple(prompts)


def _prompt_of(
    value: Any, where: str, key: str, chat: bool, system_prompt: str | None
) -> tuple[tuple[dict[str, str], ...], str | None]:
    if isinstance(value, str):
        if not value:
            raise GrpoConfigError(f"{where}: {key!r} (--input-key) is an empty string")
        if not chat:
            return (), value if system_prompt is None else f"{system_prompt}\n{value}"
        system = ({"role": "system", "content": system_prompt},) if system_prompt else ()
        return (*system, {"role": "user", "content": value}), None
    if isinstance(value, list) and value:
        messages = []
        for j, m in enumerate(value):
            if not (
                isinstance(m, Mapping)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
            ):
                raise GrpoConfigError(
                    f"{where}: {key!r} (--input-key) message {j} is not "
                    f'{{"role": str, "content": str}}: {m!r:.120}'
                )
            messages.append({"role": str(m["role"]), "content": str(m["content"])})
        if not chat:
            raise GrpoConfigError(
                f"{where}: {key!r} (--input-key) holds chat messages, which need the chat "
                "template; drop --no-apply-chat-template or give text prompts"
            )
        if system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        return tuple(messages), None
    raise GrpoConfigError(
        f"{where}: {key!r} (--input-key) is a {type(value).__name__}; expected a text or a "
        "non-empty list of chat messages"
    )


def load_prompts(
    path: Path | str,
    *,
    input_key: str,
    label_key: str | None,
    metadata_key: str | None = None,
    apply_chat_template: bool = True,
    system_prompt: str | None = None,
    flag: str = "--prompt-data",
) -> tuple[Prompt, ...]:
    """``read_rows`` then ``build_prompts``."""
    return build_prompts(
        read_rows(path, flag=flag), input_key=input_key, label_key=label_key,
        metadata_key=metadata_key, apply_chat_template=apply_chat_template,
        system_prompt=system_prompt, source=f"{flag} {path}",
    )  # fmt: skip


def config_prompts(
    cfg: GrpoConfig, path: Path | str, *, flag: str = "--prompt-data"
) -> tuple[Prompt, ...]:
    """``load_prompts`` with the config's keys, chat-template choice and system prompt."""
    return load_prompts(
        path, input_key=cfg.input_key, label_key=cfg.label_key, metadata_key=cfg.metadata_key,
        apply_chat_template=cfg.apply_chat_template, system_prompt=cfg.system_prompt, flag=flag,
    )  # fmt: skip


def fingerprint(prompts: Sequence[Prompt]) -> str:
    """A hash of what the prompts ask and what the reward reads (order included)."""
    digest = hashlib.sha256()
    for p in prompts:
        item = [p.text, list(p.messages), p.label, p.row_metadata, p.metadata]
        digest.update(json.dumps(item, sort_keys=True, default=str).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:16]


def task_from_config(cfg: GrpoConfig, decode: Callable[[Sequence[int]], str]) -> Task:
    """The run's task: ``--prompt-data`` rows scored by ``--reward``, else the built-in
    ``--task`` (its own reward, or ``--reward`` when given)."""
    if cfg.prompt_data is not None:
        if not cfg.reward:
            raise GrpoConfigError(
                "--prompt-data needs --reward (e.g. --reward math, or module:function)",
                field="reward",
            )
        prompts = config_prompts(cfg, cfg.prompt_data)
        scorer = Scorer.from_specs(cfg.reward, max_new_tokens=cfg.max_new_tokens)
        return Task(name=Path(cfg.prompt_data).stem, prompts=prompts, reward=scorer)
    task = build_task(cfg.task, decode)
    if cfg.reward:
        scorer = Scorer.from_specs(cfg.reward, max_new_tokens=cfg.max_new_tokens)
        return Task(name=task.name, prompts=task.prompts, reward=scorer)
    return task


def eval_sets(cfg: GrpoConfig) -> dict[str, tuple[Prompt, ...]]:
    """``--eval-data`` as named prompt sets (the file or directory stem; repeats numbered)."""
    out: dict[str, tuple[Prompt, ...]] = {}
    for path in cfg.eval_data:
        name = Path(path).stem or "eval"
        while name in out:
            name += "_"
        out[name] = config_prompts(cfg, path, flag="--eval-data")
    return out
