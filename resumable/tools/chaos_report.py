"""What `resumable chaos` reports: one row per fault (what, when, how it was dealt with, what it cost) and the
verdict of the comparison with an uninterrupted run."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .faultkinds import KINDS


@dataclass
class Kill:
    """One fault injected (the name is historical: most faults kill). ``signal``: KILL, TERM, INT, STOP, SEGV, or
    HANG / EIO for faults armed inside the session."""

    number: int
    signal: str
    mid_save: bool
    step_at_kill: int
    first_step: bool = False  # killed on the very first step after a resume
    resumed_from: int | None = None
    steps_lost: int | None = None
    restart_to_first_step_s: float | None = None
    fault: str = "kill"
    ended_session: bool = True
    paused_s: float | None = None  # stop-cont: how long the process was frozen
    retries: int | None = None  # drive: the client's requests to the same URL after the fault
    recovered_s: float | None = None  # drive: from the fault to the answer of a retry
    note: str | None = None  # drive: which call it hit and how it went on
    detected_s: float | None = None  # hang: from the hang to the watchdog's exit

    @property
    def cost(self) -> str:
        if self.fault == "drive":
            tries = f"{self.retries} retr{'y' if self.retries == 1 else 'ies'}"
            return f"{tries}, {self.recovered_s:.2f}s" if self.recovered_s is not None else f"{tries}, unanswered"
        if not self.ended_session:
            return f"paused {self.paused_s:.2f}s" if self.paused_s is not None else "one save retried"
        lost = f"{self.steps_lost} step(s)" if self.steps_lost is not None else "? steps"
        restart = f" + {self.restart_to_first_step_s:.2f}s restart" if self.restart_to_first_step_s is not None else ""
        detect = f" + {self.detected_s:.2f}s hung" if self.detected_s is not None else ""
        return lost + detect + restart


@dataclass
class ChaosReport:
    verdict: str  # IDENTICAL or DIVERGED
    difference: str | None
    kills: list[Kill] = field(default_factory=list)
    chaos_wall_s: float = 0.0
    reference_wall_s: float = 0.0
    fingerprint: str | None = None
    reference_fingerprint: str | None = None
    unloadable_checkpoints: int = 0
    kills_planned: int = 0
    drive_fingerprint: str | None = None  # a Drive run dir: the newest checkpoint as restored from Drive

    @property
    def goodput(self) -> float:
        return self.reference_wall_s / self.chaos_wall_s if self.chaos_wall_s else 0.0

    def to_json(self) -> dict:
        kills = [{**asdict(k), "cost": k.cost, "detected": KINDS[k.fault].detected} for k in self.kills]
        return {**asdict(self), "kills": kills, "goodput": self.goodput}


def format_report(report: ChaosReport) -> str:
    lines = [f"{'#':>4} {'fault':>13} {'step':>6} {'resumed from':>12} {'steps lost':>10} "
             f"{'restart→first step':>18}  cost"]
    for k in report.kills:
        restart = f"{k.restart_to_first_step_s:.2f}s" if k.restart_to_first_step_s is not None else "-"
        mark = "*" if k.mid_save else "^" if k.first_step else " "
        name = (f"SIG{k.signal}" if k.fault in ("kill", "term", "int") else
                f"drive {k.signal.lower()}" if k.fault == "drive" else k.fault)
        lines.append(f"{k.number:>4} {name:>13}{mark}{k.step_at_kill:>5} "
                     f"{k.resumed_from if k.resumed_from is not None else '-':>12} "
                     f"{k.steps_lost if k.steps_lost is not None else '-':>10} {restart:>18}  {k.cost}"
                     f"{f' ({k.note})' if k.note else ''}")
    lost = [k.steps_lost for k in report.kills if k.steps_lost is not None]
    lines.append("(* = killed inside a checkpoint write, ^ = on the first step after a resume)")
    for fault in dict.fromkeys(k.fault for k in report.kills):
        lines.append(f"{fault}: {KINDS[fault].detected}")
    if len(report.kills) < report.kills_planned:
        lines.append(f"the run finished after {len(report.kills)} of the {report.kills_planned} faults asked for "
                     f"(a longer run, e.g. a higher --max-steps, or a shorter --every fits them all)")
    if report.reference_wall_s:
        lines.append(f"goodput {100 * report.goodput:.1f}% (uninterrupted {report.reference_wall_s:.1f}s / "
                     f"interrupted {report.chaos_wall_s:.1f}s wall)")
    lines.append(f"lost work per fault that ended a session: {sum(lost) / len(lost) if lost else 0:.1f} steps on "
                 f"average; unloadable checkpoints: {report.unloadable_checkpoints}")
    if report.drive_fingerprint is not None:
        lines.append(f"newest checkpoint restored from Drive: fingerprint {report.drive_fingerprint}")
    verdict = report.verdict if report.difference is None else f"{report.verdict}: {report.difference}"
    lines.append(verdict)
    return "\n".join(lines)


def report_json(report: ChaosReport) -> str:
    return json.dumps(report.to_json(), indent=2)
