"""A gated rollout's shadow step (docs/shadow.md): before a wave's boxes are sent the deploy, each shadows the
candidate on its own live frames and is deployed only if it agrees with the model it serves.

Per box: a ``shadow`` command (request id ``<rollout>.<device>.shadow``), then its final shadow report, read on
the box's retained shadow topic. A report counts when it is about this rollout's candidate (its manifest sha256)
and has ended; a retained one only when this rollout had already sent the box its shadow (a re-run after a kill
reads the report the box kept), and it compared the frames asked for (one that ran out of time with fewer
fails: an idle camera must not vouch for a candidate). Its score-aware F1 against the serving model decides: at or above
``--min-agreement`` the box goes on to the deploy; below it the box ends ``disagreement``, its report's figures
and worst labels in the error, and the candidate is discarded there (``shadow-stop`` with ``discard``). A box
that answers ``unknown_verb`` runs an agent without shadow runs: it ends ``no_shadow`` and is never deployed. A
failed shadow command ends ``failed``. ``--shadow-timeout`` bounds two waits, because the box's run has its own
clock: the box answers its command once the candidate is loaded and the run started, and ends the run itself at
``max_s`` (the same value) from then. So until that answer the bound counts from the send; from it, the bound
plus REPORT_GRACE_S, so the box's own final report (one that ran out of time with too few frames included) is
what decides. No final report by then ends ``timed_out``. Each of these is a failure for the abort rules, so a
bad candidate stops the rollout in its canary, before any box serves it.
"""

from typing import Any, Callable, Dict, List, Optional

from agent.fleet.intake import Intake, one_line
from agent.fleet.journal import RolloutState
from agent.fleet.plan import DEFAULT_SHADOW_SAMPLE, request_id
from agent.fleet.records import Outcome, Phase, RolloutStatus
from agent.protocol.messages import FAILED, SUCCEEDED
from agent.protocol.requests import ShadowRequest, ShadowStopRequest
from agent.protocol.verbs import SHADOW, SHADOW_STOP

AGREES, DISAGREES = "agrees", "disagrees"
UNKNOWN_VERB = "unknown_verb"
WORST_LABELS = 3  # labels named in a disagreement's error, the worst first
REPORT_GRACE_S = 30.0  # after a started run's max_s, for its final report to reach the operator

Send = Callable[[str, str, Any, str], None]  # (device, verb, request, request id)
Judged = Callable[[str], None]  # a box's gate ended (in the state): report it, check the abort rules


class ShadowGate:
    """Runs the shadow step of one wave (see the module doc) on the rollout's intake and sender."""

    def __init__(self, intake: Intake, send: Send, rollout_id: str, progress: Callable[[str], None]) -> None:
        self.intake = intake
        self.spec = intake.spec
        self.sha = intake.spec.sha256.lower()
        self.send = send
        self.rollout_id = rollout_id
        self.progress = progress

    def run(self, state: RolloutState, devices: List[str], judged: Judged) -> List[str]:
        """Shadow ``devices`` (planned boxes); returns those that agree (judged earlier or now), in order. Boxes
        that fail the gate are finished in ``state`` (``judged`` is called for each, and may abort the rollout);
        nothing more is sent once the rollout is no longer running."""
        todo = [d for d in devices if (state.boxes[d].shadow or {}).get("verdict") != AGREES]
        if todo:
            self.intake.subscribe_acks(todo)
            self.intake.subscribe_shadow(todo)
            self.progress("shadow: %d box(es) run the candidate on %d live frames each (score-aware F1 >= %.3f "
                          "to be deployed)" % (len(todo), self.spec.shadow_frames or 0, self.spec.agreement_bound))
        deadline: Dict[str, float] = {}
        for device in todo:
            record = dict(state.boxes[device].shadow or {})
            record.setdefault("request_id", request_id(self.rollout_id, device, SHADOW))
            record.setdefault("sent_at", self.intake.clock())
            state.set(device, shadow=record)
        state.save()  # recorded before sending: a re-run sends the same request id and reads the kept report
        for device in todo:
            if state.status != RolloutStatus.RUNNING:
                break
            self.send(device, SHADOW, self._request(), state.boxes[device].shadow["request_id"])
            deadline[device] = self.intake.monotonic() + self.spec.shadow_timeout
        waiting, started = list(deadline), set()
        while waiting and state.status == RolloutStatus.RUNNING:
            self.intake.pump(state)
            for device in list(waiting):
                if device not in started and self._run_started(state, device):
                    started.add(device)  # the box ends its run at max_s from now: its own report decides
                    deadline[device] = max(deadline[device], self.intake.monotonic() + self.spec.shadow_timeout +
                                           REPORT_GRACE_S)
                if self._judge(state, device, deadline[device], device in started):
                    waiting.remove(device)
                    if state.boxes[device].phase == Phase.DONE:
                        judged(device)
            state.save()
        for device in waiting:  # the rollout stopped: what still runs there ends at its own max_s
            self._stop(state, device, discard=False)
        return [d for d in devices if (state.boxes[d].shadow or {}).get("verdict") == AGREES]

    def _request(self) -> ShadowRequest:
        archive = self.spec.archive_sha256.lower() if self.spec.archive_sha256 is not None else None
        return ShadowRequest(bundle=self.spec.bundle, sha256=self.sha, archive_sha256=archive,
                             sample=self.spec.shadow_sample or DEFAULT_SHADOW_SAMPLE,
                             frames=self.spec.shadow_frames or 1, max_s=self.spec.shadow_timeout)

    def _run_started(self, state: RolloutState, device: str) -> bool:
        """The box answered its shadow command: the candidate is loaded and its run's own clock started."""
        ack = self.intake.acks.get((device, (state.boxes[device].shadow or {}).get("request_id", "")))
        return ack is not None and ack.state == SUCCEEDED

    def _judge(self, state: RolloutState, device: str, deadline: float, started: bool) -> bool:
        """True once the box's gate ended: agreed (left for the deploy) or finished with its outcome."""
        record = dict(state.boxes[device].shadow or {})
        ack = self.intake.acks.get((device, record["request_id"]))
        if ack is not None and ack.state == FAILED:
            code = ack.error.code if ack.error is not None else "failed"
            message = one_line(ack.error.message if ack.error is not None else "")
            if code == UNKNOWN_VERB:
                return self._finish(state, device, record, Outcome.NO_SHADOW, "the box does not know the shadow "
                                    "verb (an older agent): not deployed; update it or roll out without --shadow-"
                                    "frames")
            return self._finish(state, device, record, Outcome.FAILED, "shadow: %s: %s" % (code, message))
        report = self._final_report(device, started=ack is not None and ack.state == SUCCEEDED)
        if report is not None:
            return self._verdict(state, device, record, report)
        if self.intake.monotonic() >= deadline:
            self._stop(state, device, discard=True)
            if started:
                why = "its run started, but sent no final report within --shadow-timeout %.0f s + %.0f s" % (
                    self.spec.shadow_timeout, REPORT_GRACE_S)
            else:
                why = "no answer to the shadow command within --shadow-timeout %.0f s" % self.spec.shadow_timeout
            return self._finish(state, device, record, Outcome.TIMED_OUT, why)
        return False

    def _final_report(self, device: str, started: bool) -> Optional[Dict[str, Any]]:
        """The latest ended report of this candidate from this box (a retained one counts: see the module doc)."""
        for retained, report in reversed(self.intake.shadow_reports.get(device, [])):
            if not isinstance(report, dict) or report.get("state") in (None, "running"):
                continue
            candidate = report.get("candidate") if isinstance(report.get("candidate"), dict) else {}
            if str(candidate.get("manifest_sha256", "")).lower() != self.sha:
                continue
            if retained and not started:
                continue  # kept from before: counts once the box answered this rollout's shadow command
            return report
        return None

    def _verdict(self, state: RolloutState, device: str, record: Dict[str, Any], report: Dict[str, Any]) -> bool:
        agreement = report.get("agreement") if isinstance(report.get("agreement"), dict) else {}
        aware = agreement.get("score_aware") or {}
        strict = agreement.get("strict") or {}
        f1 = aware.get("f1")
        record.update(state=report.get("state"), reason=report.get("reason"), f1=f1, strict_f1=strict.get("f1"),
                      f1_interval=aware.get("f1_interval"), frames=report.get("frames_compared"),
                      detections=agreement.get("reference_detections"), warning=agreement.get("warning"),
                      candidate_errors=report.get("candidate_errors"))
        if report.get("state") != "finished" or not isinstance(f1, (int, float)):
            self._stop(state, device, discard=True)
            return self._finish(state, device, record, Outcome.FAILED, "shadow run %s: %s" % (
                report.get("state"), one_line(str(report.get("reason")))))
        if not isinstance(record["frames"], int) or record["frames"] < (self.spec.shadow_frames or 1):
            # a run that ended on its time limit compared too little to vouch for the candidate (0 frames: F1 1.0)
            self._stop(state, device, discard=True)
            return self._finish(state, device, record, Outcome.FAILED, "the shadow run compared %s of %d "
                                "frame(s) (%s): too few to judge" % (record["frames"], self.spec.shadow_frames or 1,
                                                                    one_line(str(report.get("reason")))))
        if f1 >= self.spec.agreement_bound:
            record["verdict"] = AGREES
            state.set(device, shadow=record)
            self.progress("  %-24s agrees: score-aware F1 %.3f (strict %s) on %s frame(s), %s detection(s)" % (
                device, f1, strict.get("f1"), record["frames"], record["detections"]))
            return True
        worst = sorted(((c.get("f1", 1.0), label) for label, c in (agreement.get("per_label") or {}).items()
                        if isinstance(c, dict)))[:WORST_LABELS]
        self._stop(state, device, discard=True)
        return self._finish(state, device, record, Outcome.DISAGREEMENT, "score-aware F1 %.3f below "
                            "--min-agreement %.3f (strict %s; interval %s; %s frame(s), %s detection(s)); worst "
                            "labels: %s" % (f1, self.spec.agreement_bound, strict.get("f1"), aware.get("f1_interval"),
                                           record["frames"], record["detections"],
                                           ", ".join("%s %.2f" % (label, value) for value, label in worst) or "-"))

    def _finish(self, state: RolloutState, device: str, record: Dict[str, Any], outcome: Outcome,
                error: str) -> bool:
        """End the box with ``record`` (the caller's copy, read before it stopped the run) over the fields written
        meanwhile: the stop's request id stays, so the box's answer to the stop reads as its own."""
        record = dict(state.boxes[device].shadow or {}, **record)
        record["verdict"] = DISAGREES if outcome == Outcome.DISAGREEMENT else outcome.value
        return self.intake.finish(state, device, outcome, error, shadow=record)

    def _stop(self, state: RolloutState, device: str, discard: bool) -> None:
        """End the box's run (and with ``discard`` delete its candidate): nothing of a refused candidate stays."""
        record = dict(state.boxes[device].shadow or {})
        record["stop_id"] = request_id(self.rollout_id, device, SHADOW_STOP)
        state.set(device, shadow=record)
        self.send(device, SHADOW_STOP, ShadowStopRequest(discard=discard), record["stop_id"])
