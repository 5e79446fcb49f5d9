"""What ``localserve doctor`` found: facts about the host, and checks that pass, fail or
were skipped, each one line."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

Status = Literal["pass", "fail", "skip", "info"]


@dataclass(slots=True)
class Check:
    name: str
    status: Status
    detail: str
    figures: dict[str, float] = field(default_factory=dict)  # measured values, for --json


@dataclass(slots=True)
class Report:
    facts: dict[str, str] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, status: Status, detail: str, **figures: float) -> None:
        self.checks.append(Check(name, status, detail, figures))

    @property
    def failed(self) -> bool:
        return any(check.status == "fail" for check in self.checks)

    def lines(self) -> list[str]:
        width = max((len(key) for key in self.facts), default=0)
        out = [f"{key:<{width}}  {value}" for key, value in self.facts.items()]
        out.append("")
        out += [f"{check.status.upper():<4}  {check.name}: {check.detail}" for check in self.checks]
        return out

    def as_dict(self) -> dict[str, object]:
        return {"facts": self.facts, "checks": [asdict(check) for check in self.checks], "failed": self.failed}
