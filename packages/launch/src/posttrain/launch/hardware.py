"""Hardware profiles and GPU detection.

Hardware is *declared* (``--hardware``), not detected: a launch plan must be reproducible on a
login node with no GPU. ``detect_hardware`` reads ``nvidia-smi`` / ``rocm-smi`` output and only
warns (``HardwareMismatchWarning``) when it disagrees with the declaration; it never changes it.

Every member has an entry in every table here (a test walks the enum), so adding a member
without deciding its GPUs per node and generation fails the suite instead of raising a
``KeyError`` at launch time.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from posttrain.launch._errors import HardwareMismatchWarning, LaunchConfigError


class Vendor(StrEnum):
    NVIDIA = "nvidia"
    AMD = "amd"
    NONE = "none"


class Generation(StrEnum):
    """The accelerator architecture generation; rules branch on this, not on the SKU."""

    HOPPER = "hopper"
    BLACKWELL = "blackwell"
    CDNA3 = "cdna3"
    CDNA4 = "cdna4"
    CPU = "cpu"


class Hardware(StrEnum):
    """A node type a plan is made for; values are the spellings ``--hardware`` accepts."""

    H100 = "h100"
    H200 = "h200"
    B200 = "b200"
    B300 = "b300"
    GB200 = "gb200"
    GB300 = "gb300"
    MI300X = "mi300x"
    MI355X = "mi355x"
    CPU = "cpu"

    @property
    def gpus_per_node(self) -> int:
        return GPUS_PER_NODE[self]

    @property
    def generation(self) -> Generation:
        return GENERATION[self]

    @property
    def vendor(self) -> Vendor:
        return VENDOR[self]

    @property
    def is_blackwell(self) -> bool:
        return self.generation is Generation.BLACKWELL


# Grace-Blackwell trays carry 4 GPUs per node (NVL72 racks are 18 such trays); HGX boards 8.
GPUS_PER_NODE: dict[Hardware, int] = {
    Hardware.H100: 8,
    Hardware.H200: 8,
    Hardware.B200: 8,
    Hardware.B300: 8,
    Hardware.GB200: 4,
    Hardware.GB300: 4,
    Hardware.MI300X: 8,
    Hardware.MI355X: 8,
    Hardware.CPU: 0,
}

GENERATION: dict[Hardware, Generation] = {
    Hardware.H100: Generation.HOPPER,
    Hardware.H200: Generation.HOPPER,
    Hardware.B200: Generation.BLACKWELL,
    Hardware.B300: Generation.BLACKWELL,
    Hardware.GB200: Generation.BLACKWELL,
    Hardware.GB300: Generation.BLACKWELL,
    Hardware.MI300X: Generation.CDNA3,
    Hardware.MI355X: Generation.CDNA4,
    Hardware.CPU: Generation.CPU,
}

VENDOR: dict[Hardware, Vendor] = {
    Hardware.H100: Vendor.NVIDIA,
    Hardware.H200: Vendor.NVIDIA,
    Hardware.B200: Vendor.NVIDIA,
    Hardware.B300: Vendor.NVIDIA,
    Hardware.GB200: Vendor.NVIDIA,
    Hardware.GB300: Vendor.NVIDIA,
    Hardware.MI300X: Vendor.AMD,
    Hardware.MI355X: Vendor.AMD,
    Hardware.CPU: Vendor.NONE,
}

# Product-name patterns, most specific first (GB200 before B200, H200 before H100 is moot,
# but "GB" must win over "B"). Matched case-insensitively against the reported GPU name.
_NAME_PATTERNS: tuple[tuple[re.Pattern[str], Hardware], ...] = (
    (re.compile(r"\bGB300\b", re.I), Hardware.GB300),
    (re.compile(r"\bGB200\b", re.I), Hardware.GB200),
    (re.compile(r"\bB300\b", re.I), Hardware.B300),
    (re.compile(r"\bB200\b", re.I), Hardware.B200),
    (re.compile(r"\bH200\b", re.I), Hardware.H200),
    (re.compile(r"\bH100\b", re.I), Hardware.H100),
    (re.compile(r"\bMI355X\b", re.I), Hardware.MI355X),
    (re.compile(r"\bMI300X\b", re.I), Hardware.MI300X),
)

NVIDIA_SMI_ARGV: tuple[str, ...] = ("nvidia-smi", "--query-gpu=name,memory.total", "--format=csv")
ROCM_SMI_ARGV: tuple[str, ...] = ("rocm-smi", "--showproductname", "--json")


def parse_hardware(value: str) -> Hardware:
    """Parse a ``--hardware`` value; the error lists every accepted spelling."""
    try:
        return Hardware(value.strip().lower())
    except ValueError:
        allowed = ", ".join(h.value for h in Hardware)
        raise LaunchConfigError(f"hardware {value!r} is not one of: {allowed}") from None


def hardware_from_gpu_name(name: str) -> Hardware | None:
    """Map a reported product name ('NVIDIA H100 80GB HBM3', 'AMD Instinct MI300X OAM')."""
    for pattern, hardware in _NAME_PATTERNS:
        if pattern.search(name):
            return hardware
    return None


def parse_nvidia_smi(output: str) -> list[str]:
    """GPU names from ``nvidia-smi --query-gpu=name,... --format=csv[,noheader]`` output."""
    names: list[str] = []
    for line in output.splitlines():
        first = line.split(",")[0].strip()
        if not first or first == "name" or first.startswith(("index", "No devices")):
            continue
        # Tolerate an index column first ("0, NVIDIA H200, 143771 MiB").
        cells = [c.strip() for c in line.split(",")]
        name = cells[1] if cells[0].isdigit() and len(cells) > 1 else cells[0]
        if name:
            names.append(name)
    return names


def parse_rocm_smi(output: str) -> list[str]:
    """GPU names from ``rocm-smi --showproductname`` output, in its JSON or its text form."""
    text = output.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise LaunchConfigError(f"rocm-smi JSON output is malformed: {exc}") from exc
        names = []
        for key, card in data.items():
            if not key.lower().startswith("card") or not isinstance(card, dict):
                continue
            series = {k.lower(): v for k, v in card.items()}.get("card series")
            if isinstance(series, str):
                names.append(series.strip())
        return names
    by_gpu: dict[str, str] = {}
    for line in text.splitlines():
        match = re.match(r"\s*GPU\[(\d+)\]\s*:\s*Card series:\s*(.+?)\s*$", line, re.I)
        if match:
            by_gpu.setdefault(match.group(1), match.group(2))
    return [by_gpu[k] for k in sorted(by_gpu, key=int)]


@dataclass(frozen=True, slots=True, kw_only=True)
class Detection:
    """What the machine reports: the tool asked, every GPU name, and the hardware they map to.

    ``hardware`` is None when no GPU tool answered (``tool`` is then None, meaning CPU) or
    when the GPUs are of a kind no profile describes.
    """

    tool: str | None
    gpu_names: tuple[str, ...]
    hardware: Hardware | None

    @property
    def gpu_count(self) -> int:
        return len(self.gpu_names)


def run_tool(argv: Sequence[str], timeout_s: float = 10.0) -> str | None:
    """Run a GPU query tool; None when it is not installed or fails (then it reports nothing)."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def detect_hardware(
    declared: Hardware | None = None,
    *,
    run: Callable[[Sequence[str]], str | None] = run_tool,
) -> Detection:
    """Ask nvidia-smi, then rocm-smi; warn when the answer disagrees with ``declared``.

    ``run`` is the seam tests use to feed recorded tool outputs. Mixed GPU models on one node
    map to None (no profile describes them) and warn the same way.
    """
    detection = Detection(tool=None, gpu_names=(), hardware=Hardware.CPU)
    for argv, parse in ((NVIDIA_SMI_ARGV, parse_nvidia_smi), (ROCM_SMI_ARGV, parse_rocm_smi)):
        output = run(argv)
        if output is None:
            continue
        names = tuple(parse(output))
        if not names:
            continue
        kinds = {hardware_from_gpu_name(n) for n in names}
        hardware = kinds.pop() if len(kinds) == 1 else None
        detection = Detection(tool=argv[0], gpu_names=names, hardware=hardware)
        break
    if declared is None:
        return detection
    if detection.hardware is not declared:
        seen = ", ".join(sorted(set(detection.gpu_names))) or "no GPU"
        warnings.warn(
            f"declared hardware {declared.value} but {detection.tool or 'this machine'} "
            f"reports {detection.gpu_count} x [{seen}] "
            f"(-> {detection.hardware.value if detection.hardware else 'unknown'}); "
            f"keeping the declared {declared.value}",
            HardwareMismatchWarning,
            stacklevel=2,
        )
    elif detection.gpu_count != declared.gpus_per_node:
        warnings.warn(
            f"declared hardware {declared.value} has {declared.gpus_per_node} GPUs per node "
            f"but {detection.tool or 'this machine'} reports {detection.gpu_count}; "
            f"plans still assume {declared.gpus_per_node}",
            HardwareMismatchWarning,
            stacklevel=2,
        )
    return detection
