"""What a rollout was asked to do: the spec, the waves, request ids (its abort rules are in ``judge.py``).

Pure functions and a frozen spec, no I/O: the engine (``rollout.py``) applies them, the state file
(``journal.py``) keeps the spec so that a re-run must ask the same.
"""

import hashlib
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from agent.config.names import name_problem
from agent.fleet.records import FAILURES
from agent.protocol.messages import REQUEST_ID_MAX, REQUEST_ID_RE
from agent.protocol.verbs import DEPLOY

ROLLOUT_ID_MAX = 24  # leaves room in a 64-character request id for the device and the verb
DEFAULT_CONFIRM_TIMEOUT_S = 900.0  # a deploy plus a box's default 60 s observation window, with a wide margin
DEFAULT_REVERT_TIMEOUT_S = 120.0  # a rollback is a reference swap or one reload: a slow box still answers
DEFAULT_RETRIES = 2  # a transient 'busy' or 'interrupted' is sent again this many times
RETRY_BASE_S = 2.0  # backoff before retry n: RETRY_BASE_S * 2**(n-1)
RETRYABLE = ("busy", "interrupted")  # error codes that say "not now", not "never"
DEFAULT_MIN_AGREEMENT = 0.95  # score-aware F1 a gated rollout's candidate must reach on each box
DEFAULT_SHADOW_SAMPLE = 1.0


class RolloutError(Exception):
    """Bad arguments, or a state file that does not belong to this command; nothing was sent."""


def _bad_number(value: Optional[float]) -> bool:
    return value is not None and not math.isfinite(value)


@dataclass(frozen=True)
class RolloutSpec:
    """What a rollout was asked to do: a re-run must ask the same (the state file keeps it)."""

    group: str
    bundle: str
    sha256: str
    prefix: str = "atlas-edge"
    archive_sha256: Optional[str] = None  # the file a box downloads; boxes require it for a URL
    canary: int = 1
    waves: int = 3
    wave_size: Optional[int] = None
    max_failures: Optional[int] = None
    max_failure_rate: Optional[float] = None
    min_executed: int = 1
    confirm_timeout_s: float = DEFAULT_CONFIRM_TIMEOUT_S
    rollback_on_abort: bool = False
    wait_offline_s: Optional[float] = None
    step_timeout_s: Optional[float] = None  # silence allowed before a deploy ends; progress restarts it
    retries: int = DEFAULT_RETRIES
    max_per_minute: Optional[int] = None
    max_per_type: Dict[str, int] = field(default_factory=dict)  # outcome -> most boxes allowed to end so
    continue_after_canary_failure: bool = False
    pause_after_canary: bool = False
    revert_timeout_s: float = DEFAULT_REVERT_TIMEOUT_S
    # A gated rollout (docs/shadow.md): each box first shadows the candidate on this many live frames; None: no
    # gate. The others apply only with it (None: their defaults, so that a state file from before them compares
    # equal on a re-run).
    shadow_frames: Optional[int] = None
    min_agreement: Optional[float] = None  # score-aware F1 bound (default DEFAULT_MIN_AGREEMENT)
    shadow_sample: Optional[float] = None  # share of frames offered (default DEFAULT_SHADOW_SAMPLE)
    shadow_timeout_s: Optional[float] = None  # for the final report, from the shadow command (default confirm's)

    def check(self) -> None:
        problems = []
        problem = name_problem(self.group)
        if problem:
            problems.append("--group %s" % problem)
        problems += prefix_problems(self.prefix)
        if not self.bundle:
            problems.append("--bundle must not be empty")
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256.lower()):
            problems.append("--sha256 must be 64 hex digits (the manifest's, as 'bundle verify' prints)")
        if self.archive_sha256 is not None and (len(self.archive_sha256) != 64 or any(
                c not in "0123456789abcdef" for c in self.archive_sha256.lower())):
            problems.append("--archive-sha256 must be 64 hex digits (sha256sum of the archive file)")
        if "://" in self.bundle and self.archive_sha256 is None:
            problems.append("--archive-sha256 is required for a URL bundle (boxes check the download against it "
                            "before unpacking)")
        if self.canary < 0 or self.waves < 1 or (self.wave_size is not None and self.wave_size < 1):
            problems.append("--canary must be >= 0, --waves and --wave-size >= 1")
        if self.max_failures is not None and self.max_failures < 0:
            problems.append("--max-failures must be >= 0")
        numbers = {"--max-failure-rate": self.max_failure_rate, "--confirm-timeout": self.confirm_timeout_s,
                   "--wait-offline": self.wait_offline_s, "--step-timeout": self.step_timeout_s,
                   "--revert-timeout": self.revert_timeout_s}
        problems += ["%s must be a finite number" % name for name, v in numbers.items() if _bad_number(v)]
        if self.max_failure_rate is not None and not 0 <= self.max_failure_rate < 1:
            problems.append("--max-failure-rate must be in [0, 1)")
        if self.min_executed < 1 or not self.confirm_timeout_s > 0:
            problems.append("--min-executed must be >= 1 and --confirm-timeout > 0")
        for name, value in (("--wait-offline", self.wait_offline_s), ("--step-timeout", self.step_timeout_s),
                            ("--revert-timeout", self.revert_timeout_s)):
            if value is not None and not value > 0:
                problems.append("%s must be > 0" % name)
        if self.retries < 0 or (self.max_per_minute is not None and self.max_per_minute < 1):
            problems.append("--retries must be >= 0 and --max-per-minute >= 1")
        for outcome, limit in self.max_per_type.items():
            if outcome not in FAILURES or limit < 0:
                problems.append("--max-per-type %s=%s: the type is one of %s and the limit >= 0" % (
                    outcome, limit, ", ".join(FAILURES)))
        problems += self._shadow_problems()
        if problems:
            raise RolloutError("; ".join(problems))

    def _shadow_problems(self) -> List[str]:
        gate = {"--min-agreement": self.min_agreement, "--shadow-sample": self.shadow_sample,
                "--shadow-timeout": self.shadow_timeout_s}
        if self.shadow_frames is None:
            given = [name for name, value in gate.items() if value is not None]
            return ["%s needs --shadow-frames (the gate is off without it)" % ", ".join(given)] if given else []
        problems = []
        if not 1 <= self.shadow_frames <= 100000:
            problems.append("--shadow-frames must be in [1, 100000]")
        for name, value in (("--min-agreement", self.min_agreement), ("--shadow-sample", self.shadow_sample)):
            if value is not None and not 0 < value <= 1:
                problems.append("%s must be in (0, 1]" % name)
        if self.shadow_timeout_s is not None and not 0 < self.shadow_timeout_s <= 86400:
            problems.append("--shadow-timeout must be in (0, 86400]")
        return problems

    @property
    def gated(self) -> bool:
        return self.shadow_frames is not None

    @property
    def agreement_bound(self) -> float:
        return DEFAULT_MIN_AGREEMENT if self.min_agreement is None else self.min_agreement

    @property
    def shadow_timeout(self) -> float:
        return self.confirm_timeout_s if self.shadow_timeout_s is None else self.shadow_timeout_s

    @property
    def step_timeout(self) -> float:
        return self.step_timeout_s if self.step_timeout_s is not None else self.confirm_timeout_s

    def default_id(self) -> str:
        """Same command, same id: what makes a plain re-run resume instead of starting over."""
        key = "\n".join((self.prefix, self.group, self.bundle, self.sha256.lower()))
        return "ro-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]


def prefix_problems(prefix: str) -> List[str]:
    """A topic prefix is one or more levels without wildcards (``x/#`` would subscribe to anything)."""
    problem = name_problem(prefix, levels=True)
    return ["--prefix %s" % problem] if problem else []


def check_rollout_id(rollout_id: str) -> str:
    if not rollout_id or len(rollout_id) > ROLLOUT_ID_MAX or not REQUEST_ID_RE.match(rollout_id):
        raise RolloutError("--rollout-id must be 1-%d characters of A-Z a-z 0-9 _ . : -" % ROLLOUT_ID_MAX)
    return rollout_id


def request_id(rollout_id: str, device: str, verb: str) -> str:
    """``<rollout>.<device>.<verb>``; a device id that does not fit a request id is replaced by its hash."""
    candidate = "%s.%s.%s" % (rollout_id, device, verb)
    if len(candidate) <= REQUEST_ID_MAX and REQUEST_ID_RE.match(candidate):
        return candidate
    return "%s.h%s.%s" % (rollout_id, hashlib.sha256(device.encode("utf-8")).hexdigest()[:16], verb)


def deploy_verb(attempt: int) -> str:
    """The request id's verb part for a deploy: a retry is a new request (the box's record answers the old)."""
    return DEPLOY if attempt == 0 else "%s-r%d" % (DEPLOY, attempt)


def plan_waves(devices: List[str], canary: int, waves: int, wave_size: Optional[int]) -> List[List[str]]:
    """Canary first (if any), then ``waves`` near-equal waves, or waves of ``wave_size``."""
    head, rest = devices[:canary], devices[canary:]
    planned = [head] if head else []
    if not rest:
        return planned
    if wave_size is None:
        count = min(waves, len(rest))
        size, extra = divmod(len(rest), count)
        start = 0
        for index in range(count):
            end = start + size + (1 if index < extra else 0)
            planned.append(rest[start:end])
            start = end
    else:
        planned += [rest[i:i + wave_size] for i in range(0, len(rest), wave_size)]
    return planned


def spec_arguments(spec: RolloutSpec) -> List[str]:
    """The options of ``fleet rollout`` that describe ``spec`` (``agent.cli.fleet_options.rollout_spec`` of them
    gives it back): how the console starts the rollout command."""
    argv = ["--group", spec.group, "--bundle", spec.bundle, "--sha256", spec.sha256, "--prefix", spec.prefix,
            "--canary", str(spec.canary), "--min-executed", str(spec.min_executed),
            "--confirm-timeout", repr(spec.confirm_timeout_s), "--retries", str(spec.retries),
            "--revert-timeout", repr(spec.revert_timeout_s)]
    argv += ["--wave-size", str(spec.wave_size)] if spec.wave_size is not None else ["--waves", str(spec.waves)]
    optional = (("--archive-sha256", spec.archive_sha256), ("--max-failures", spec.max_failures),
                ("--max-failure-rate", spec.max_failure_rate), ("--wait-offline", spec.wait_offline_s),
                ("--step-timeout", spec.step_timeout_s), ("--max-per-minute", spec.max_per_minute),
                ("--shadow-frames", spec.shadow_frames), ("--min-agreement", spec.min_agreement),
                ("--shadow-sample", spec.shadow_sample), ("--shadow-timeout", spec.shadow_timeout_s))
    for option, value in optional:
        if value is not None:
            argv += [option, repr(value) if isinstance(value, float) else str(value)]
    for outcome, limit in sorted(spec.max_per_type.items()):
        argv += ["--max-per-type", "%s=%d" % (outcome, limit)]
    flags = (("--rollback-on-abort", spec.rollback_on_abort), ("--pause-after-canary", spec.pause_after_canary),
             ("--continue-after-canary-failure", spec.continue_after_canary_failure))
    return argv + [flag for flag, on in flags if on]
