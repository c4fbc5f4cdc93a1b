"""Hardware profiles and detection from recorded nvidia-smi / rocm-smi outputs."""

from collections.abc import Sequence
from pathlib import Path

import pytest

from posttrain.launch import (
    Generation,
    Hardware,
    HardwareMismatchWarning,
    LaunchConfigError,
    Vendor,
    detect_hardware,
    parse_hardware,
    parse_nvidia_smi,
    parse_rocm_smi,
)
from posttrain.launch.hardware import GENERATION, GPUS_PER_NODE, VENDOR, hardware_from_gpu_name

DATA = Path(__file__).parent / "data" / "smi"


def feed(nvidia: str | None = None, rocm: str | None = None):  # type: ignore[no-untyped-def]
    """A ``run`` seam answering like a machine with these tool outputs (None: no tool)."""
    asked: list[str] = []

    def run(argv: Sequence[str]) -> str | None:
        asked.append(argv[0])
        name = nvidia if argv[0] == "nvidia-smi" else rocm
        return None if name is None else (DATA / name).read_text()

    run.asked = asked  # type: ignore[attr-defined]
    return run


def test_every_member_has_every_table_entry() -> None:
    for table in (GPUS_PER_NODE, GENERATION, VENDOR):
        assert set(table) == set(Hardware)
    for hw in Hardware:
        assert isinstance(hw.gpus_per_node, int)
        assert hw.generation in Generation
        assert hw.vendor in Vendor


def test_profile_facts() -> None:
    assert Hardware.GB200.gpus_per_node == Hardware.GB300.gpus_per_node == 4
    assert {h for h in Hardware if h.gpus_per_node == 8} == {
        Hardware.H100, Hardware.H200, Hardware.B200, Hardware.B300, Hardware.MI300X,
        Hardware.MI355X,
    }  # fmt: skip
    assert {h for h in Hardware if h.is_blackwell} == {
        Hardware.B200, Hardware.B300, Hardware.GB200, Hardware.GB300,
    }  # fmt: skip
    assert Hardware.CPU.gpus_per_node == 0


@pytest.mark.parametrize(
    ("nvidia", "rocm", "expected", "count"),
    [
        ("nvidia-smi-h100.csv", None, Hardware.H100, 8),
        ("nvidia-smi-h200.csv", None, Hardware.H200, 8),
        ("nvidia-smi-b200.csv", None, Hardware.B200, 8),
        ("nvidia-smi-b300.csv", None, Hardware.B300, 8),
        ("nvidia-smi-gb200-noheader.csv", None, Hardware.GB200, 4),
        ("nvidia-smi-gb300.csv", None, Hardware.GB300, 4),
        (None, "rocm-smi-mi300x.txt", Hardware.MI300X, 8),
        (None, "rocm-smi-mi355x.json", Hardware.MI355X, 8),
        (None, None, Hardware.CPU, 0),
    ],
)
def test_detects_each_recorded_machine(
    nvidia: str | None, rocm: str | None, expected: Hardware, count: int
) -> None:
    detection = detect_hardware(run=feed(nvidia, rocm))
    assert detection.hardware is expected
    assert detection.gpu_count == count


def test_declared_matching_detection_is_silent(recwarn: pytest.WarningsRecorder) -> None:
    assert detect_hardware(Hardware.B200, run=feed("nvidia-smi-b200.csv")).hardware is Hardware.B200
    assert not [w for w in recwarn if issubclass(w.category, HardwareMismatchWarning)]


def test_disagreement_only_warns_and_names_both() -> None:
    with pytest.warns(HardwareMismatchWarning, match=r"declared hardware b200.*NVIDIA H200"):
        detection = detect_hardware(Hardware.B200, run=feed("nvidia-smi-h200.csv"))
    assert detection.hardware is Hardware.H200  # reported as seen; the caller keeps b200


def test_fewer_gpus_than_the_profile_warns() -> None:
    with pytest.warns(HardwareMismatchWarning, match="8 GPUs per node.*reports 4"):
        detection = detect_hardware(Hardware.H200, run=feed("nvidia-smi-h200-indexed-4.csv"))
    assert detection.gpu_names == ("NVIDIA H200",) * 4


def test_mixed_node_maps_to_no_profile() -> None:
    detection = detect_hardware(run=feed("nvidia-smi-mixed.csv"))
    assert detection.hardware is None
    assert detection.gpu_count == 2


def test_cpu_machine_declared_gpu_warns() -> None:
    with pytest.warns(HardwareMismatchWarning, match="no GPU"):
        detect_hardware(Hardware.H100, run=feed())


def test_nvidia_asked_before_rocm() -> None:
    run = feed("nvidia-smi-h100.csv", "rocm-smi-mi300x.txt")
    assert detect_hardware(run=run).hardware is Hardware.H100
    assert run.asked == ["nvidia-smi"]  # type: ignore[attr-defined]


def test_parsers_directly() -> None:
    assert parse_nvidia_smi("No devices were found\n") == []
    assert (
        parse_rocm_smi((DATA / "rocm-smi-mi300x.txt").read_text())
        == ["AMD Instinct MI300X OAM"] * 8
    )
    assert len(parse_rocm_smi((DATA / "rocm-smi-mi355x.json").read_text())) == 8  # "system" skipped
    with pytest.raises(LaunchConfigError, match="rocm-smi JSON"):
        parse_rocm_smi("{not json")
    assert hardware_from_gpu_name("NVIDIA GB200") is Hardware.GB200  # not B200
    assert hardware_from_gpu_name("NVIDIA A100-SXM4-80GB") is None


def test_parse_hardware_lists_choices() -> None:
    assert parse_hardware(" H200 ") is Hardware.H200
    with pytest.raises(LaunchConfigError, match="'a100' is not one of: h100, h200"):
        parse_hardware("a100")
