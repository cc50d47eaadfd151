"""Read NPU memory, utilisation, temperature and power from Huawei's ``npu-smi`` tool: parsers for its two text
formats and a sampling probe.

``npu-smi info`` prints a table with two rows per chip::

    | NPU     Name      | Health          | Power(W)     Temp(C)           Hugepages-Usage(page) |
    | Chip    Device    | Bus-Id          | AICore(%)    Memory-Usage(MB)  [HBM-Usage(MB)]       |
    | 0       310P3     | OK              | 15.8         42                0    / 0              |
    | 0       0         | 0000:82:00.0    | 0            1074 / 21534                            |

The first row names the NPU (the id ``npu-smi -i`` takes) and its chip, with its power (W) and temperature
(C); the second carries the AI Core utilisation (%) and the memory figures as ``used / total`` in MB. Power,
temperature and utilisation are read where the header names them and the cell holds a number: ``NA``, ``-``
or a missing cell is "not reported" (None), never 0 (310B boards print a power of 0.0: kept as printed).
910-class parts show ``Memory-Usage(MB)`` (often ``0 / 0``) and
``HBM-Usage(MB)``; 310, 310B and 310P parts show ``Memory-Usage(MB)`` only. The ``Device`` column (logical
id, what pyACL and mindspore_lite call ``device_id``) is absent on some versions. ``npu-smi info -t usages
-i N`` prints ``Key : value`` lines whose names vary by version, hence the alias lists.

These parsers were written against documented and published outputs (tests/fixtures/npu_smi), not run on our
boxes. The tool is not on this machine; the probe takes its ``runner`` as a parameter so tests drive it with
stand-ins.
"""

import logging
import re
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

log = logging.getLogger(__name__)

NPU_SMI = "npu-smi"
# npu-smi answers well within a second on a healthy driver; a stalled driver must not stall the watchdog.
DEFAULT_TIMEOUT_S = 5.0
MAX_DISTINCT_ERRORS_LOGGED = 32  # bounds the "already logged" set on a box that fails in many ways
ERROR_TEXT_CHARS = 160

_PAIR = re.compile(r"(\d+)\s*/\s*(\d+)")
_USAGE_COLUMN = re.compile(r"\b(Memory|HBM)-Usage\(MB\)", re.IGNORECASE)
_ROW1_FIRST = re.compile(r"^(\d+)\s+(\S+)$")  # "0       310B4": NPU id, chip name
_ROW2_FIRST = re.compile(r"^(\d+)(?:\s+(\d+))?$")  # "0       0": chip id [, logical device id]
_HEALTH = re.compile(r"^[A-Za-z][A-Za-z-]*$")  # OK, Warning, Alarm, Critical, UNKNOWN ...
_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?$")
_BUS = re.compile(r"^(?:[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]|NA|-)$")

# canonical key -> the names different npu-smi versions print for it (compared without case and spaces)
USAGE_ALIASES: Dict[str, Tuple[str, ...]] = {
    "memory_usage_pct": ("Memory Usage Rate(%)", "DDR Usage Rate(%)"),
    "hbm_usage_pct": ("HBM Usage Rate(%)",),
    "aicore_usage_pct": ("Aicore Usage Rate(%)", "AICore Usage Rate(%)", "AI Core Usage Rate(%)"),
    "aivector_usage_pct": ("Aivector Usage Rate(%)",),
    "aicpu_usage_pct": ("Aicpu Usage Rate(%)",),
    "ctrlcpu_usage_pct": ("Ctrlcpu Usage Rate(%)",),
    "memory_capacity_mb": ("Memory Capacity(MB)", "DDR Capacity(MB)"),
    "hbm_capacity_mb": ("HBM Capacity(MB)",),
    "memory_bandwidth_pct": ("Memory Bandwidth Usage Rate(%)", "DDR Bandwidth Usage Rate(%)"),
    "hbm_bandwidth_pct": ("HBM Bandwidth Usage Rate(%)",),
}


def _squash(name: str) -> str:
    return "".join(name.split()).lower()


_ALIAS_TO_KEY = {_squash(alias): key for key, aliases in USAGE_ALIASES.items() for alias in aliases}


class NpuSmiFormatError(ValueError):
    """npu-smi printed something these parsers do not recognise (the message quotes the offending line)."""


@dataclass(frozen=True)
class NpuMemory:
    """One chip's memory as ``npu-smi info`` reports it, in MB (npu-smi's unit)."""

    device_id: int  # the NPU id: what `npu-smi info -i` takes
    chip_name: str  # e.g. 310B4; "Ascend" + this is the ATC --soc_version
    used_mb: int  # Memory-Usage (on 310/310B boards: the whole board's DDR, shared with the host OS)
    total_mb: int
    hbm_used_mb: Optional[int] = None  # HBM-Usage, 910-class only
    hbm_total_mb: Optional[int] = None
    chip_id: int = 0
    logical_id: Optional[int] = None  # the "Device" column when printed: pyACL / mindspore_lite device_id
    health: str = ""
    power_w: Optional[float] = None  # None where npu-smi prints NA, "-" or nothing
    temperature_c: Optional[float] = None
    aicore_pct: Optional[float] = None  # AICore(%): npu-exporter's npu_chip_info_utilization

    @property
    def exporter_id(self) -> int:
        """npu-exporter's ``id`` label: the logical id where npu-smi prints it, else the NPU id."""
        return self.logical_id if self.logical_id is not None else self.device_id

    @property
    def device_used_mb(self) -> int:
        """The memory models live in: HBM where the chip has it, else Memory-Usage."""
        return self.hbm_used_mb if self.hbm_total_mb else self.used_mb

    @property
    def device_total_mb(self) -> int:
        return self.hbm_total_mb if self.hbm_total_mb else self.total_mb  # type: ignore[return-value]


def chip_figures(reading: Any) -> Dict[str, Any]:
    """npu-exporter's figures of one reading: ``id`` and those npu-smi reported of ``utilization`` (AICore %),
    ``temperature`` (C) and ``power`` (W); {} when it reported none or is not npu-smi's (a backend's own)."""
    chip_id = getattr(reading, "exporter_id", None)
    if chip_id is None:
        return {}
    figures = {"utilization": reading.aicore_pct, "temperature": reading.temperature_c, "power": reading.power_w}
    reported = {name: value for name, value in figures.items() if value is not None}
    return dict(reported, id=chip_id) if reported else {}


def _cells(line: str) -> List[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_npu_smi_info(text: str) -> List[NpuMemory]:
    """Every chip in an ``npu-smi info`` table, in printed order.

    Raises :class:`NpuSmiFormatError` when no chip row is found or a chip's first row is not followed by its
    memory row: a half-parsed table must not pass as a reading.
    """
    columns = ["memory", "hbm"]  # order of used/total pairs in the second row; refined by the header
    first_names: List[str] = []  # names of the first row's figures (Power(W), Temp(C), ...) from its header
    aicore = False  # whether the second row's figures start with AICore(%)
    chips: List[NpuMemory] = []
    pending: Optional[Tuple[int, str, str, int, Dict[str, Optional[float]]]] = None  # a first row, parsed
    for number, line in enumerate(text.splitlines(), 1):
        if "|" not in line:
            continue
        cells = _cells(line)
        if not any(cells) or set("".join(cells)) <= set("+-= "):
            continue  # blank row or a border
        if _USAGE_COLUMN.search(line):
            columns = [m.group(1).lower() for m in _USAGE_COLUMN.finditer(line)]
            aicore = len(cells) >= 3 and cells[2].lower().startswith("aicore(%)")
            continue
        if len(cells) >= 3 and ("power(w)" in cells[2].lower() or "temp(c)" in cells[2].lower()):
            first_names = [name.lower() for name in cells[2].split()]
            continue
        if "process id" in line.lower():
            break  # the per-process table follows the chip table; its rows look like chip rows
        if pending is not None:
            chips.append(_second_row(cells, pending, columns, line, aicore))
            pending = None
            continue
        if len(cells) >= 3:
            first = _ROW1_FIRST.match(cells[0])
            if first and _HEALTH.match(cells[1]) and not _BUS.match(cells[1]):
                pending = (int(first.group(1)), first.group(2), cells[1], number,
                           _named_figures(first_names, cells[2]))
    if pending is not None:
        raise NpuSmiFormatError("line %d: chip row %r has no memory row after it" % (pending[3], pending[1]))
    if not chips:
        raise NpuSmiFormatError("no chip rows found in npu-smi info output (starts %r)" % _head(text))
    return chips


def _number(token: Optional[str]) -> Optional[float]:
    """A figure as printed, or None for NA, "-", "N/A" or no cell: not reported is not zero."""
    return float(token) if token is not None and _NUMBER.match(token) else None


def _named_figures(names: List[str], cell: str) -> Dict[str, Optional[float]]:
    """The first row's figures by header name; a cell shorter than its header leaves the rest unreported."""
    tokens = cell.split()
    return {name: _number(tokens[i] if i < len(tokens) else None) for i, name in enumerate(names)
            if name in ("power(w)", "temp(c)")}


def _leading_figure(cell: str) -> Optional[float]:
    """The figure before the cell's first ``used / total`` pair (AICore(%)); None where the pair comes first."""
    pair = _PAIR.search(cell)
    head = (cell[:pair.start()] if pair else cell).split()
    return _number(head[0]) if head else None


def _second_row(cells: List[str], first: Tuple[int, str, str, int, Dict[str, Optional[float]]],
                columns: List[str], line: str, aicore: bool) -> NpuMemory:
    npu_id, name, health, number, figures_1 = first
    ids = _ROW2_FIRST.match(cells[0]) if cells else None
    if ids is None or len(cells) < 3:
        raise NpuSmiFormatError("line %d: expected the memory row of chip %s, got %r" % (number + 1, name,
                                                                                         _cut(line)))
    pairs = _PAIR.findall(" ".join(cells[2:]))
    figures: Dict[str, Tuple[int, int]] = {}
    for column, (used, total) in zip(columns, pairs):
        figures[column] = (int(used), int(total))
    if "memory" not in figures and "hbm" not in figures:
        raise NpuSmiFormatError("line %d: no 'used / total' figures in %r" % (number + 1, _cut(line)))
    used, total = figures.get("memory", (0, 0))
    hbm = figures.get("hbm")
    return NpuMemory(
        device_id=npu_id, chip_name=name, used_mb=used, total_mb=total,
        hbm_used_mb=hbm[0] if hbm else None, hbm_total_mb=hbm[1] if hbm else None,
        chip_id=int(ids.group(1)), logical_id=int(ids.group(2)) if ids.group(2) is not None else None,
        health=health, power_w=figures_1.get("power(w)"), temperature_c=figures_1.get("temp(c)"),
        aicore_pct=_leading_figure(cells[2]) if aicore else None,
    )


def parse_npu_smi_usages(text: str) -> Dict[str, float]:
    """Known figures from ``npu-smi info -t usages -i N`` under canonical names (see :data:`USAGE_ALIASES`).

    Unknown keys are ignored; values printed as ``NA`` are left out. With several chips under one NPU the
    first value of each key is kept. Raises :class:`NpuSmiFormatError` when no known key is present.
    """
    result: Dict[str, float] = {}
    for line in text.splitlines():
        if ":" not in line:
            continue
        name, _, value = line.strip().strip("|").partition(":")
        key = _ALIAS_TO_KEY.get(_squash(name))
        if key is None or key in result:
            continue
        try:
            result[key] = float(value.strip())
        except ValueError:
            continue  # "NA" or a version-specific non-number: absent, not zero
    if not result:
        raise NpuSmiFormatError("no known usage fields in npu-smi output (starts %r)" % _head(text))
    return result


def _head(text: str) -> str:
    stripped = text.strip()
    return _cut(stripped.splitlines()[0] if stripped else "")


def _cut(text: str) -> str:
    text = text.strip()
    return text if len(text) <= ERROR_TEXT_CHARS else text[: ERROR_TEXT_CHARS - 3] + "..."


Runner = Callable[..., Any]


class NpuSmiProbe:
    """Samples one chip's memory by running ``npu-smi info``; ``read()`` never raises.

    ``device_id`` is matched against the table's logical ``Device`` column where npu-smi prints it (the id
    pyACL and mindspore_lite use), else against the NPU id. A missing npu-smi is logged once and not
    retried (it does not appear while we run); any other failure is counted in ``failures`` and each distinct
    message is logged once, so a box whose tool is broken does not fill the journal at every sample.
    """

    def __init__(self, device_id: int = 0, runner: Runner = subprocess.run,
                 timeout_s: float = DEFAULT_TIMEOUT_S, executable: str = NPU_SMI) -> None:
        self.device_id = device_id
        self.timeout_s = timeout_s
        self.executable = executable
        self.failures = 0
        self.absent = False
        self.last: Optional[NpuMemory] = None
        self._runner = runner
        self._logged: Set[str] = set()

    def read(self) -> Optional[NpuMemory]:
        if self.absent:
            return None
        try:
            text = self._run()
            reading = self._select(parse_npu_smi_info(text))
        except FileNotFoundError:
            self.absent = True
            log.warning("%s not found: NPU memory will not be reported (install the Ascend driver's npu-smi, "
                        "or run without an NPU)", self.executable)
            return None
        except (OSError, subprocess.SubprocessError, NpuSmiFormatError, _ProbeError) as exc:
            self._fail(exc)
            return None
        self.last = reading
        return reading

    def _run(self) -> str:
        cmd = [self.executable, "info"]
        done = self._runner(cmd, capture_output=True, text=True, timeout=self.timeout_s, check=False)
        if done.returncode != 0:
            detail = (done.stderr or done.stdout or "").strip()
            raise _ProbeError("%s exited with %d: %s" % (" ".join(cmd), done.returncode, _head(detail)))
        return done.stdout or ""

    def _select(self, chips: List[NpuMemory]) -> NpuMemory:
        with_logical = [c for c in chips if c.logical_id is not None]
        if with_logical:
            match = [c for c in with_logical if c.logical_id == self.device_id]
        else:
            match = [c for c in chips if c.device_id == self.device_id]
        if not match:
            seen = ["%d(%s)" % (c.logical_id if c.logical_id is not None else c.device_id, c.chip_name)
                    for c in chips]
            raise _ProbeError("device %d not in npu-smi output (devices: %s)" % (
                self.device_id, ", ".join(seen)))
        return match[0]

    def _fail(self, exc: Exception) -> None:
        self.failures += 1
        text = "%s: %s" % (type(exc).__name__, exc)
        if text in self._logged or len(self._logged) >= MAX_DISTINCT_ERRORS_LOGGED:
            log.debug("npu-smi read failed again (%d failures): %s", self.failures, text)
            return
        self._logged.add(text)
        log.warning("npu-smi read failed (%d failures so far; each distinct error is logged once): %s",
                    self.failures, text)


class _ProbeError(Exception):
    """npu-smi ran but did not give us our chip's memory."""
