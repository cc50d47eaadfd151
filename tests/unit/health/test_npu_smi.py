"""npu-smi parsing against written-format fixtures, and the probe's error handling.

The fixtures were written from documented and published outputs, not captured on a box
(tests/fixtures/npu_smi/README.md). npu-smi itself is not installed here: the probe is driven by stand-in
runners (named below), and once through the real ``subprocess.run`` with a stand-in script for the tool.
"""

import logging
import os
import shutil
import stat
import subprocess
from typing import List, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.health.npu_smi import (
    NpuMemory,
    NpuSmiFormatError,
    NpuSmiProbe,
    chip_figures,
    parse_npu_smi_info,
    parse_npu_smi_usages,
)

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "fixtures", "npu_smi")


def fixture(name: str) -> str:
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as handle:
        return handle.read()


INFO_EXPECTED = {
    "info-atlas-200dk-310.txt": [
        NpuMemory(0, "310", 2703, 8192, None, None, chip_id=0, logical_id=0, health="OK",
                  power_w=12.8, temperature_c=49, aicore_pct=0)],
    "info-atlas-200i-dk-a2-310b4.txt": [
        NpuMemory(0, "310B4", 2500, 7545, None, None, chip_id=0, logical_id=0, health="Alarm",
                  power_w=0.0, temperature_c=58, aicore_pct=0)],
    "info-atlas-300i-pro-310p3.txt": [
        NpuMemory(0, "310P3", 1074, 21534, None, None, chip_id=0, logical_id=0, health="OK",
                  power_w=15.8, temperature_c=42, aicore_pct=0),
        NpuMemory(1, "310P3", 934, 21534, None, None, chip_id=0, logical_id=1, health="OK",
                  power_w=17.0, temperature_c=56, aicore_pct=3)],
    "info-910b-contrast.txt": [
        NpuMemory(0, "910B3", 0, 0, 3318, 65536, chip_id=0, logical_id=None, health="OK",
                  power_w=101.8, temperature_c=43, aicore_pct=0),
        NpuMemory(1, "910B3", 0, 0, 53984, 65536, chip_id=0, logical_id=None, health="OK",
                  power_w=92.0, temperature_c=39, aicore_pct=7)],
    "info-atlas-500-310-na.txt": [  # NA and an empty cell are "not reported" (None), never 0
        NpuMemory(0, "310", 3306, 7764, None, None, chip_id=0, logical_id=0, health="OK",
                  power_w=None, temperature_c=53, aicore_pct=None),
        NpuMemory(1, "310", 2890, 7764, None, None, chip_id=0, logical_id=1, health="Warning",
                  power_w=None, temperature_c=None, aicore_pct=41)],
}


def test_the_exporter_id_is_the_logical_id_where_printed_else_the_npu_id():
    assert [c.exporter_id for c in parse_npu_smi_info(fixture("info-atlas-300i-pro-310p3.txt"))] == [0, 1]
    assert [c.exporter_id for c in parse_npu_smi_info(fixture("info-910b-contrast.txt"))] == [0, 1]
    chip = NpuMemory(3, "310", 1, 2, chip_id=0, logical_id=None)
    assert chip.exporter_id == 3 and NpuMemory(3, "310", 1, 2, logical_id=5).exporter_id == 5


def test_chip_figures_are_npu_exporters_names_with_unreported_ones_left_out():
    on_310, not_reported = parse_npu_smi_info(fixture("info-atlas-500-310-na.txt"))
    assert chip_figures(on_310) == {"id": 0, "temperature": 53.0}
    assert chip_figures(not_reported) == {"id": 1, "utilization": 41.0}
    assert chip_figures(parse_npu_smi_info(fixture("info-910b-contrast.txt"))[1]) == {
        "id": 1, "utilization": 7.0, "temperature": 39.0, "power": 92.0}
    assert chip_figures(NpuMemory(0, "310", 1, 2)) == {}  # none reported: no id alone
    assert chip_figures(object()) == {}  # a backend's own memory reading carries none of these


def test_a_table_without_power_and_aicore_columns_reports_none_not_a_memory_figure():
    text = ("| NPU     Name      | Health          | Temp(C)                                |\n"
            "| Chip    Device    | Bus-Id          | Memory-Usage(MB)                       |\n"
            "| 0       310       | OK              | 47                                     |\n"
            "| 0       0         | NA              | 2703 / 8192                            |\n")
    chip, = parse_npu_smi_info(text)
    assert (chip.used_mb, chip.total_mb, chip.power_w, chip.aicore_pct) == (2703, 8192, None, None)
    assert chip.temperature_c == 47  # named by the header: the one figure is the temperature, not the power


@pytest.mark.parametrize("name", sorted(INFO_EXPECTED))
def test_info_fixtures_parse_to_golden_values(name):
    assert parse_npu_smi_info(fixture(name)) == INFO_EXPECTED[name]


def test_every_info_fixture_is_covered():
    on_disk = {f for f in os.listdir(FIXTURES) if f.startswith("info-")}
    assert on_disk == set(INFO_EXPECTED) | {"info-garbled.txt"}


def test_device_memory_is_hbm_on_910_and_memory_elsewhere():
    ascend310p, = parse_npu_smi_info(fixture("info-atlas-300i-pro-310p3.txt"))[:1]
    assert (ascend310p.device_used_mb, ascend310p.device_total_mb) == (1074, 21534)
    ascend910 = parse_npu_smi_info(fixture("info-910b-contrast.txt"))[1]
    assert (ascend910.device_used_mb, ascend910.device_total_mb) == (53984, 65536)


def test_garbled_output_is_an_error_naming_the_line():
    with pytest.raises(NpuSmiFormatError, match=r"line 8: expected the memory row of chip 310B4"):
        parse_npu_smi_info(fixture("info-garbled.txt"))


@pytest.mark.parametrize("text", [
    "",
    "dcmi module initialize failed. ret is -8005\n",
    "+------+\n| NPU     Name      | Health |\n+======+\n",
    # a chip row whose last row is cut off at the end of the output
    "| 0       310P3     | OK              | 15.8         42                0    / 0              |\n",
])
def test_outputs_without_a_complete_chip_are_errors(text):
    with pytest.raises(NpuSmiFormatError):
        parse_npu_smi_info(text)


USAGES_EXPECTED = {
    "usages-310p3.txt": {"memory_capacity_mb": 21534, "memory_usage_pct": 5, "aicore_usage_pct": 12,
                         "aicpu_usage_pct": 0, "ctrlcpu_usage_pct": 3, "memory_bandwidth_pct": 1},
    # "Aicpu Usage Rate(%) : NA" is absent, not zero
    "usages-310b4.txt": {"memory_capacity_mb": 7545, "memory_usage_pct": 33, "aicore_usage_pct": 0,
                         "ctrlcpu_usage_pct": 9, "memory_bandwidth_pct": 2},
    "usages-910b.txt": {"memory_capacity_mb": 0, "memory_usage_pct": 0, "hbm_capacity_mb": 65536,
                        "hbm_usage_pct": 82, "aicore_usage_pct": 7, "aivector_usage_pct": 0,
                        "aicpu_usage_pct": 0, "ctrlcpu_usage_pct": 2, "memory_bandwidth_pct": 0,
                        "hbm_bandwidth_pct": 4},
}


@pytest.mark.parametrize("name", sorted(USAGES_EXPECTED))
def test_usages_fixtures_parse_to_golden_values(name):
    assert parse_npu_smi_usages(fixture(name)) == USAGES_EXPECTED[name]


def test_usages_without_known_fields_is_an_error():
    with pytest.raises(NpuSmiFormatError, match="no known usage fields"):
        parse_npu_smi_usages("NPU ID : 0\nChip Count : 1\n")


# ---------------------------------------------------------------------------------------------- properties

ROW1 = "| {npu:<7} {name:<9} | {health:<15} | {power:<12} {temp:<17} 0    / 0              |"
ROW2 = "| {chip:<7} {dev:<9} | {bus:<15} | {aicore:<12} {used} / {total:<28}|"
HEADER = ("| NPU     Name      | Health          | Power(W)     Temp(C)           Hugepages-Usage(page) |\n"
          "| Chip    Device    | Bus-Id          | AICore(%)    Memory-Usage(MB)                        |\n"
          "+===================+=================+======================================================+")

chip_rows = st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(1, 10 ** 6),
                               st.sampled_from(["310", "310P3", "310B4"]), st.sampled_from(["OK", "Alarm"])),
                     min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(chip_rows)
def test_rendered_tables_round_trip(rows):
    """Tables rendered in the 310P3 layout with arbitrary figures parse back to exactly those figures."""
    lines = [HEADER]
    for index, (used, total, name, health) in enumerate(rows):
        lines.append(ROW1.format(npu=index, name=name, health=health, power="15.8", temp=42))
        lines.append(ROW2.format(chip=0, dev=index, bus="0000:%02X:00.0" % index, aicore=3, used=used,
                                 total=total))
        lines.append("+===================+=================+" + "=" * 54 + "+")
    chips = parse_npu_smi_info("\n".join(lines))
    assert [(c.device_id, c.logical_id, c.chip_name, c.health, c.used_mb, c.total_mb) for c in chips] == [
        (i, i, name, health, used, total) for i, (used, total, name, health) in enumerate(rows)]
    assert {(c.power_w, c.temperature_c, c.aicore_pct) for c in chips} == {(15.8, 42, 3)}


AICORE_NAMES = ["Aicore Usage Rate(%)", "AICore Usage Rate(%)", "AI Core Usage Rate(%)",
                "aicore usage rate (%)"]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 100), st.integers(0, 100), st.sampled_from(AICORE_NAMES), st.integers(0, 12))
def test_usage_aliases_and_spacing(memory, aicore, aicore_name, pad):
    gap = " " * pad
    text = "  NPU ID : 0\n%s%s : %d\n    DDR Usage Rate(%%)%s:   %d\n" % (
        gap, aicore_name, aicore, gap, memory)
    assert parse_npu_smi_usages(text) == {"aicore_usage_pct": aicore, "memory_usage_pct": memory}


# ---------------------------------------------------------------------------------------------- the probe


class FakeNpuSmiRunner:
    """Stand-in for subprocess.run: answers `npu-smi info` with canned output, or raises; counts calls."""

    def __init__(self, stdout: str = "", returncode: int = 0, stderr: str = "",
                 raises: Optional[Exception] = None) -> None:
        self.stdout, self.returncode, self.stderr, self.raises = stdout, returncode, stderr, raises
        self.calls: List[List[str]] = []

    def __call__(self, cmd, **kwargs):
        self.calls.append(list(cmd))
        assert kwargs["timeout"] > 0 and kwargs["capture_output"] and kwargs["text"]
        if self.raises is not None:
            raise self.raises
        return subprocess.CompletedProcess(cmd, self.returncode, self.stdout, self.stderr)


def warnings_from(caplog) -> List[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "agent.health.npu_smi" and r.levelno >= logging.WARNING]


def test_probe_reads_its_logical_device():
    runner = FakeNpuSmiRunner(fixture("info-atlas-300i-pro-310p3.txt"))
    reading = NpuSmiProbe(device_id=1, runner=runner).read()
    assert (reading.device_id, reading.used_mb, reading.total_mb) == (1, 934, 21534)
    assert runner.calls == [["npu-smi", "info"]]


def test_probe_matches_npu_id_when_no_logical_column():
    reading = NpuSmiProbe(device_id=1, runner=FakeNpuSmiRunner(fixture("info-910b-contrast.txt"))).read()
    assert reading.hbm_used_mb == 53984


def test_absent_npu_smi_is_reported_once_and_not_retried(caplog):
    runner = FakeNpuSmiRunner(raises=FileNotFoundError(2, "No such file or directory", "npu-smi"))
    probe = NpuSmiProbe(runner=runner)
    with caplog.at_level(logging.DEBUG, logger="agent.health.npu_smi"):
        readings = [probe.read() for _ in range(50)]
    assert readings == [None] * 50
    assert len(warnings_from(caplog)) == 1 and "not found" in warnings_from(caplog)[0]
    assert len(runner.calls) == 1
    assert probe.absent


def test_failures_are_counted_and_each_distinct_error_logged_once(caplog):
    runner = FakeNpuSmiRunner(returncode=255, stderr="dcmi module initialize failed. ret is -8005")
    probe = NpuSmiProbe(runner=runner)
    with caplog.at_level(logging.DEBUG, logger="agent.health.npu_smi"):
        for _ in range(20):
            assert probe.read() is None
        runner.returncode, runner.stdout = 0, fixture("info-garbled.txt")
        for _ in range(20):
            assert probe.read() is None
        runner.raises = subprocess.TimeoutExpired(["npu-smi", "info"], 5.0)
        for _ in range(5):
            assert probe.read() is None
    assert probe.failures == 45
    logged = warnings_from(caplog)
    assert len(logged) == 3
    assert "exited with 255: dcmi module initialize failed" in logged[0]
    assert "line 8" in logged[1] and "TimeoutExpired" in logged[2]
    runner.raises, runner.stdout = None, fixture("info-atlas-200i-dk-a2-310b4.txt")
    assert probe.read().used_mb == 2500  # recovers once the tool answers again


def test_missing_device_names_the_devices_seen(caplog):
    probe = NpuSmiProbe(device_id=3, runner=FakeNpuSmiRunner(fixture("info-atlas-300i-pro-310p3.txt")))
    with caplog.at_level(logging.WARNING, logger="agent.health.npu_smi"):
        assert probe.read() is None
    assert "device 3 not in npu-smi output (devices: 0(310P3), 1(310P3))" in warnings_from(caplog)[0]


def test_probe_through_real_subprocess_with_a_stand_in_tool(tmp_path):
    """The real subprocess.run path, with a stand-in script printing a fixture in place of npu-smi."""
    tool = tmp_path / "fake-npu-smi"
    tool.write_text("#!/bin/sh\n[ \"$1\" = info ] || exit 3\ncat '%s'\n"
                    % os.path.join(FIXTURES, "info-atlas-200dk-310.txt"))
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    reading = NpuSmiProbe(executable=str(tool)).read()
    assert (reading.chip_name, reading.used_mb, reading.total_mb) == ("310", 2703, 8192)


@pytest.mark.skipif(shutil.which("npu-smi") is None, reason="needs the Ascend driver's npu-smi (Atlas box)")
def test_real_npu_smi_output_parses():
    chips = parse_npu_smi_info(subprocess.run(["npu-smi", "info"], capture_output=True, text=True,
                                              timeout=30, check=True).stdout)
    assert chips and all(c.device_total_mb > 0 for c in chips)


def test_the_watchdogs_sample_carries_the_chip_figures_of_its_npu_smi_reading():
    """What the daemon's status (``npu_chip``) and the metrics endpoint read: the watchdog's last sample."""
    from agent.config.daemon_config import WatchdogConfig
    from agent.health.memory import MemoryWatchdog

    probe = NpuSmiProbe(device_id=1, runner=FakeNpuSmiRunner(fixture("info-atlas-300i-pro-310p3.txt")))
    sample = MemoryWatchdog(WatchdogConfig(), npu_probe=probe, read_limit=lambda: None).sample()
    assert (sample.npu_used_mb, dict(sample.npu_chip)) == (
        934.0, {"id": 1, "utilization": 3.0, "temperature": 56.0, "power": 17.0})
    assert dict(MemoryWatchdog(WatchdogConfig(), read_limit=lambda: None).sample().npu_chip) == {}
