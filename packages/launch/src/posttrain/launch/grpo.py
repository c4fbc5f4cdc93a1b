"""``posttrain grpo``: the embedded CPU recipe, a real GRPO job on a laptop with one command.

1. ``python -m posttrain.grpo.recipe prepare`` writes (or reuses, from the cache) the recipe's
   checkpoints: a tiny Dense/MoE policy warmed up on the toy task, its stronger teacher and,
   with ``--rollout-quant nvfp4``, the policy converted to NVFP4.
2. The local stack of ``posttrain up`` starts on 127.0.0.1: the local engines behind the stock
   sgl-router and the session router (with LoRA on and the trained adapter's name when an
   adapter is trained), plus a teacher engine with ``--opd`` (unless ``--teacher URL``), with
   a random API key per stack (``keys.py``) that the engines' weight routes and the session
   router require.
3. The trainer runs as ``python -m posttrain.grpo`` (gloo ranks, HSDP: ``--replicate 1 --shard
   RANKS``) with the recipe's flags and ``--api-key-file`` (the key file, never the key itself,
   in its argv), in the foreground: its live display goes straight to this terminal.
4. Every process is stopped by pid, whatever happened.

Topology (``local_topology``): every process runs one torch thread, so on a small machine the
processes share few cores. With fewer than 4 usable cores (``usable_cores``: the process's CPU
affinity, capped by a cgroup CPU quota) the run starts **1 engine** and **1 trainer rank**,
else 2 of each. On 2 cores one engine decodes a step's 64 samples in one batch as fast as two
engines decode 32 each, and the weight push goes to one engine instead of two
(docs/benchmarks/grpo.md, "Topology"); since a group's samples share their prompt in the
packed batch, one trainer rank trains the recipe's step faster than two (no collectives, no
wait for the slower rank: 0.029-0.036 against 0.041-0.056 s, "Issue 38, seventh session").
The engine count changes no sample (the strict kernels are batch-invariant:
the same tokens and logprobs on any engine, in any batch), so the run learns exactly as with
2 engines. ``--engines N`` sets the engine count; ``-- --replicate R --shard S`` the trainer's
mesh (the trainer's own flags win, as every flag after ``--``).

``--turn-timeout S`` is the deadline of one rollout turn, end to end: the session router's
``--upstream-timeout-s`` and the trainer's ``--turn-timeout-s``. A turn past it (a frozen
engine) is an aborted sample the step leaves out, not a failed run.

``--model-path DIR`` trains the user's own checkpoint (any family ``posttrain.models``
supports) instead of the recipe's policy: the recipe step only gives the task's settings, the
engines serve DIR (with its tokenizer), the trainer trains it, the LoRA targets are the recipe's
that exist in DIR's architecture, and the trainer's ``--dry-run`` applies the model gate before
any process starts. ``--context-length N`` is the KV capacity of the engines and the trainer.

Launch never imports posttrain.grpo: both the recipe and the trainer are ``python -m``
commands, so the CLI stays light. They run on this interpreter (``sys.executable``), as every
process of the stack does (``LocalRunner``): the ``python`` on PATH may be another one. Flags
after ``--`` go to the trainer unchanged (last wins).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from posttrain.launch._errors import LaunchConfigError, RecipeError
from posttrain.launch.catalog import mla_lora_targets
from posttrain.launch.keys import new_api_key, remove_key_file, write_key_file
from posttrain.launch.plan import Plan
from posttrain.launch.runners import LocalRunner, LogSink, _set_pdeathsig
from posttrain.launch.stack import (
    TEACHER,
    LocalStackConfig,
    build_local_stack,
    policy_engine_names,
)
from posttrain.launch.tables import EngineKind

ADAPTER = "policy"


@dataclass(frozen=True, slots=True, kw_only=True)
class GrpoRecipeConfig:
    """What ``posttrain grpo`` was asked for (see the command's help)."""

    train: Literal["lora", "full"] = "lora"
    task: str = "addition"
    opd: bool = False
    teacher_url: str | None = None
    rollout_quant: Literal["none", "nvfp4"] = "none"
    steps: int | None = None
    seed: int = 0
    resume: Path | None = None
    out: Path = Path("runs/grpo")
    engines: int | None = None  # None: from the core count (``local_topology``)
    trainer_args: tuple[str, ...] = ()
    data_args: tuple[str, ...] = ()  # the user's data/reward/eval flags (``data_flags``)
    ready_timeout_s: float = 300.0
    turn_timeout_s: float | None = None  # None: the trainer's and the session router's defaults
    model_path: Path | None = None  # None: the recipe's own tiny policy
    context_length: int | None = None  # None: the model's max_position_embeddings
    dry_run: bool = False  # every check (recipe, trainer's --dry-run), then stop: no process

    def __post_init__(self) -> None:
        if self.train not in ("lora", "full"):
            raise LaunchConfigError(f"--train must be lora or full, got {self.train!r}")
        if self.rollout_quant not in ("none", "nvfp4"):
            raise LaunchConfigError(
                f"--rollout-quant must be none or nvfp4, got {self.rollout_quant!r}"
            )
        if self.steps is not None and self.steps < 1:
            raise LaunchConfigError(f"--steps must be >= 1, got {self.steps}")
        if not self.task or not self.task.replace("_", "").isalnum():
            raise LaunchConfigError(
                f"--task must be a task name, got {self.task!r}; for your own prompts give "
                "--prompt-data FILE (with --input-key, --label-key, --reward)"
            )
        if self.engines is not None and self.engines < 1:
            raise LaunchConfigError(f"--engines must be >= 1, got {self.engines}")
        if self.turn_timeout_s is not None and not 0 < self.turn_timeout_s < math.inf:
            raise LaunchConfigError(
                f"--turn-timeout must be a finite number of seconds > 0, got {self.turn_timeout_s}"
            )
        if self.context_length is not None and self.context_length < 1:
            raise LaunchConfigError(f"--context-length must be >= 1, got {self.context_length}")
        if self.model_path is not None:
            if not (Path(self.model_path) / "config.json").is_file():
                raise LaunchConfigError(
                    f"--model-path {self.model_path}: not a checkpoint directory (no config.json)"
                )
            if self.rollout_quant != "none":
                raise LaunchConfigError(
                    "--rollout-quant nvfp4 serves the recipe's own NVFP4 conversion; with "
                    f"--model-path, convert it with `quant-convert nvfp4 --model-dir "
                    f"{self.model_path} --save-dir OUT` and train it with `python -m "
                    f"posttrain.grpo --model-path {self.model_path} --engine-model-path OUT`"
                )
            if self.opd and self.teacher_url is None:
                raise LaunchConfigError(
                    "--opd with --model-path needs --teacher URL: the recipe's teacher speaks "
                    "the recipe's vocabulary, not DIR's"
                )
        if self.teacher_url is not None and not self.teacher_url.startswith(
            ("http://", "https://")
        ):
            raise LaunchConfigError(f"--teacher must be an http(s) URL, got {self.teacher_url!r}")


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
"""cgroup v2's CPU quota of this process's group: ``max PERIOD`` or ``QUOTA PERIOD``."""


def usable_cores(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The cores this process may run on: its CPU affinity (where the OS has one), capped by a
    cgroup v2 CPU quota (a container's ``--cpus``), rounded up, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS)
        cores = os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):  # no cgroup v2 quota here, or one we cannot read
        pass
    return cores


@dataclass(frozen=True, slots=True)
class Topology:
    """How many policy engines and trainer ranks a run starts, and what chose them."""

    engines: int
    trainer_ranks: int
    cores: int
    engines_given: bool = False
    ranks_given: bool = False

    def describe(self) -> str:
        """One line for the run's plan (what starts, and what chose it)."""
        engines = f"{self.engines} engine{'s' if self.engines != 1 else ''}"
        ranks = f"{self.trainer_ranks} trainer rank{'s' if self.trainer_ranks != 1 else ''}"
        cores = f"{self.cores} core{'s' if self.cores != 1 else ''}"
        engines += " (--engines)" if self.engines_given else ""
        ranks += " (-- --replicate/--shard)" if self.ranks_given else ""
        if self.engines_given and self.ranks_given:
            return f"{engines} and {ranks}"
        return f"{engines} and {ranks}, for {cores} (--engines N, -- --shard N to change)"


def local_topology(
    cores: int, engines: int | None = None, trainer_args: Sequence[str] = ()
) -> Topology:
    """The run's engines and trainer ranks: ``engines`` when given, else 1 below 4 cores and 2
    from 4; trainer ranks ``--replicate`` x ``--shard`` where ``trainer_args`` give either (the
    last of each wins, as the trainer reads them), else 1 below 4 cores and 2 from 4 (see the
    module docstring)."""
    chosen = engines if engines is not None else (1 if cores < 4 else 2)
    ranks = 1 if cores < 4 else 2
    mesh = {"--replicate": 1, "--shard": ranks}
    given = False
    args = list(trainer_args)
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in mesh:
            if not eq:
                value = args[i + 1] if i + 1 < len(args) else ""
            with contextlib.suppress(ValueError):  # a bad value: the trainer names it
                mesh[name], given = int(value), True
    return Topology(engines=chosen, trainer_ranks=mesh["--replicate"] * mesh["--shard"],
                    cores=cores, engines_given=engines is not None, ranks_given=given)  # fmt: skip


def data_flags(**values: Any) -> tuple[str, ...]:
    """The trainer flags of the user's data, reward and eval options (None: not given; a list:
    the flag repeated; a bool: ``--flag`` / ``--no-flag``)."""
    out: list[str] = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list | tuple):
            for item in value:
                out += [flag, str(item)]
        else:
            out += [flag, str(value)]
    return tuple(out)


def prepare_recipe(
    cfg: GrpoRecipeConfig, sink: LogSink, *, python: str = sys.executable
) -> dict[str, Any]:
    """Run the recipe's prepare command; returns its JSON (checkpoint paths, recipe flags)."""
    argv = [python, "-m", "posttrain.grpo.recipe", "prepare", "--seed", str(cfg.seed),
            "--task", cfg.task]  # fmt: skip
    if cfg.rollout_quant == "nvfp4":
        argv.append("--nvfp4")
    if cfg.model_path is not None:  # the user's model: the task's settings, no checkpoints
        argv.append("--settings-only")
    sink("recipe", " ".join(argv))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_set_pdeathsig)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise RecipeError("the recipe's prepare step did not finish within 30 minutes") from None
    for line in err.splitlines():
        sink("recipe", line)
    if proc.returncode != 0:  # its own one-line error when it gave one (already in the log)
        said = [
            line.removeprefix("error: ") for line in err.splitlines() if line.startswith("error: ")
        ]
        raise RecipeError(
            f"the recipe's prepare step refused: {said[-1]}"
            if said
            else f"`{' '.join(argv)}` failed ({proc.returncode}): {err[-2000:]}"
        )
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def trainer_argv(cfg: GrpoRecipeConfig, recipe: dict[str, Any], urls: dict[str, str],
                 engine_names: list[str], key_file: Path | None = None, *,
                 python: str = sys.executable, trainer_ranks: int = 2) -> list[str]:  # fmt: skip
    """The ``python -m posttrain.grpo`` command of the recipe (user flags last: they win).

    ``python`` is this interpreter by default, as ``LocalRunner`` resolves a plan's ``python``:
    the ``python`` on PATH may be another one, without the workspace installed.
    """
    settings = dict(recipe["recipe"])
    if cfg.steps is not None:
        settings["steps"] = cfg.steps
    if cfg.train == "full":  # full-weight training has its own learning rate in the recipe
        settings["lr"] = settings.get("full_lr", settings["lr"])
    argv = [
        python, "-m", "posttrain.grpo",
        "--model-path", policy_path(cfg, recipe),
        "--rollout-url", urls["session-router"],
        "--engine-urls", ",".join(urls[n] for n in engine_names),
        "--train", cfg.train,
        "--task", cfg.task,
        "--seed", str(cfg.seed),
        "--out-dir", str(cfg.out),
        "--replicate", "1", "--shard", str(trainer_ranks),
        "--lora-name", ADAPTER,
    ]  # fmt: skip
    for key in ("prompts_per_step", "samples_per_prompt", "max_new_tokens", "temperature", "lr",
                "lora_r", "lora_alpha", "max_grad_norm", "steps"):  # fmt: skip
        argv += ["--" + key.replace("_", "-"), str(settings[key])]
    targets = list(settings["lora_targets"])
    if cfg.model_path is not None:
        targets = lora_targets_for(cfg.model_path, targets)
    argv += ["--lora-targets", ",".join(targets)]
    if cfg.context_length is not None:
        argv += ["--context-length", str(cfg.context_length)]
    teacher = cfg.teacher_url or urls.get(TEACHER)
    if cfg.opd:
        argv += ["--opd", "--teacher-url", str(teacher), "--opd-top-k", str(settings["opd_top_k"]),
                 "--opd-kl-coef", str(settings["opd_kl_coef"])]  # fmt: skip
    if cfg.rollout_quant == "nvfp4":  # the engines serve the NVFP4 conversion
        argv += ["--rollout-quant", "nvfp4", "--tis", str(settings["tis"]),
                 "--engine-model-path", recipe["policy_nvfp4"]]  # fmt: skip
    if cfg.resume is not None:
        argv += ["--resume", str(cfg.resume)]
    if cfg.turn_timeout_s is not None:
        argv += ["--turn-timeout-s", str(cfg.turn_timeout_s)]
    if key_file is not None:
        argv += ["--api-key-file", str(key_file)]
    if "router" in urls:  # a lost engine is deregistered there until it is re-admitted
        argv += ["--router-url", urls["router"]]
    return argv + list(cfg.data_args) + list(cfg.trainer_args)


def policy_path(cfg: GrpoRecipeConfig, recipe: dict[str, Any]) -> str:
    """The checkpoint the engines serve and the trainer trains: ``--model-path`` or the
    recipe's policy."""
    return str(cfg.model_path) if cfg.model_path is not None else str(recipe["policy"])


_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def lora_targets_for(model_dir: Path, wanted: list[str]) -> list[str]:
    """The ``wanted`` LoRA targets that are linears of ``model_dir``'s architecture: the MLP's
    ``gate_proj``/``up_proj``/``down_proj`` only where some layer has a dense MLP (a routed
    expert's projections are not LoRA sites); the attention projections always. With MLA
    (``kv_lora_rank``: DeepSeek-V3, GLM-4.x-MoE-Lite) the attention targets name MLA's own
    projections: ``q_proj`` is ``q_a_proj`` + ``q_b_proj`` where ``q_lora_rank`` is set,
    ``k_proj``/``v_proj`` are ``kv_a_proj_with_mqa`` + ``kv_b_proj``."""
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    if hf.get("kv_lora_rank"):
        wanted = mla_lora_targets(wanted, q_lora=hf.get("q_lora_rank") is not None)
    experts = max(int(hf.get(k) or 0) for k in _EXPERT_KEYS)
    types = hf.get("mlp_layer_types")
    step = hf.get("decoder_sparse_step") or 1
    dense = (
        not experts
        or (isinstance(types, list) and "dense" in types)
        or bool(hf.get("mlp_only_layers"))
        or bool(hf.get("first_k_dense_replace"))  # DeepSeek-V3's leading dense layers
        or (isinstance(step, int) and step > 1)
    )
    return [t for t in wanted if dense or t not in _MLP_TARGETS]


def run_grpo(
    cfg: GrpoRecipeConfig,
    sink: LogSink,
    *,
    python: str = sys.executable,
    topology: Topology | None = None,
) -> int:
    """Prepare, start the stack, run the trainer in the foreground, stop everything.

    ``python`` runs the recipe, every process of the stack and the trainer (default: this one);
    ``topology`` the engines and trainer ranks (default: ``local_topology`` of this machine).
    """
    if topology is None:
        topology = local_topology(usable_cores(), cfg.engines, cfg.trainer_args)
    sink("launcher", f"topology: {topology.describe()}")
    recipe = prepare_recipe(cfg, sink, python=python)
    policy = policy_path(cfg, recipe)
    served = recipe["policy_nvfp4"] if cfg.rollout_quant == "nvfp4" else policy
    key = new_api_key()
    key_file = write_key_file(key, f"grpo-{os.getpid()}")
    sink("launcher", f"api-key-file {key_file}")
    try:
        # The trainer's own checks (the model gate, data, reward, eval sets, out-dir, --resume)
        # before any process starts, once: an unsupported --model-path or a bad --prompt-data
        # fails here, in seconds.
        checked = _trainer_preflight(cfg, recipe, key_file, python, topology.trainer_ranks)
        if cfg.dry_run:
            sys.stdout.write(checked)
            sys.stdout.write(
                "posttrain grpo --dry-run: every check passed; nothing was started (the URLs and "
                "the key file above are stand-ins: a run starts its stack on free ports)\n"
            )
            sys.stdout.flush()
            return 0
        plan = build_local_stack(
            LocalStackConfig(
                model_path=served,
                tokenizer_path=policy,
                engines=topology.engines,
                engine_kind=EngineKind.LOCAL,
                lora_adapter=ADAPTER if cfg.train == "lora" else None,
                teacher_model_path=recipe["teacher"]
                if cfg.opd and cfg.teacher_url is None
                else None,
                ready_timeout_s=cfg.ready_timeout_s,
                turn_timeout_s=cfg.turn_timeout_s,
                api_key=key,
                engine_args=()
                if cfg.context_length is None
                else ("--context-length", str(cfg.context_length)),
                api_key_file=str(key_file),
            )
        )
        return _run_stack_and_trainer(
            cfg, recipe, plan, sink, key, key_file, python, topology.trainer_ranks
        )
    finally:
        remove_key_file(key_file)


def _trainer_preflight(
    cfg: GrpoRecipeConfig, recipe: dict[str, Any], key_file: Path, python: str, ranks: int
) -> str:
    """``python -m posttrain.grpo ... --dry-run`` with the run's own flags (stand-in URLs: no
    stack is up yet); returns what it printed (the resolved config). A refusal raises
    ``RecipeError`` with its last ``error:`` line, the lines before it (one per other failed
    check) going to stderr first."""
    stand_in = dict.fromkeys(
        ("session-router", "router", "engine-0", TEACHER), "http://127.0.0.1:9"
    )
    argv = trainer_argv(cfg, recipe, stand_in, ["engine-0"], key_file, python=python,
                        trainer_ranks=ranks)  # fmt: skip
    done = subprocess.run([*argv, "--dry-run"], capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return done.stdout
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    if not lines:
        raise RecipeError(f"the trainer's --dry-run exited with code {done.returncode}")
    if lines[:-1]:
        sys.stderr.write("\n".join(lines[:-1]) + "\n")
        sys.stderr.flush()
    raise RecipeError(lines[-1].removeprefix("error: "))


def _run_stack_and_trainer(
    cfg: GrpoRecipeConfig,
    recipe: dict[str, Any],
    plan: Plan,
    sink: LogSink,
    key: str,
    key_file: Path,
    python: str,
    ranks: int,
) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # The runner probes readiness with the key and masks it in every log line it relays.
    with LocalRunner(plan, sink=sink, base_env=env, api_key=key, python=python) as runner:
        runner.start()
        engines = policy_engine_names(plan)
        argv = trainer_argv(cfg, recipe, dict(runner.urls), engines, key_file, python=python,
                            trainer_ranks=ranks)  # fmt: skip
        sink("launcher", "trainer: " + " ".join(argv))
        trainer = subprocess.Popen(argv, preexec_fn=_set_pdeathsig)
        try:
            return trainer.wait()
        except KeyboardInterrupt:
            with contextlib.suppress(ProcessLookupError):
                trainer.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                trainer.wait(timeout=30)
            if trainer.poll() is None:
                trainer.kill()
            raise
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
            sys.stderr.flush()
