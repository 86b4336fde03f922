"""Statistics of speculative decoding: one type for the decoder, the API, the server, bench and demo.

``acceptance_length`` (tau) is the mean number of tokens committed per drafting step: the accepted
drafted tokens plus the target's own token of every step, over the steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

PHASES = ("prefill", "draft", "verify", "inject", "rollback")


def acceptance_length(accepted: int, steps: int) -> float:
    """Mean tokens committed per drafting step (0.0 before the first step)."""
    return (accepted + steps) / steps if steps else 0.0


@dataclass
class GenerationStats:
    """What one or more generations did. ``tau`` = mean tokens committed per drafting step."""
    n_prompt: int = 0
    n_reused: int = 0
    n_generated: int = 0
    steps: int = 0             # drafting steps (a verified block of >= 1 drafted token)
    passes: int = 0            # target passes that commit tokens: every step, drafting or plain (a prompt's last
                               # pass too where it gives the first token: decoder._fusable)
    drafted: int = 0           # drafted tokens verified
    accepted: int = 0
    unverified: int = 0        # drafted tokens a drafter's confidence left unverified (decoding.confidence)
    copy_steps: int = 0        # steps whose block prompt lookup copied (among ``steps``; decoding.ngram)
    copied: int = 0            # ... their tokens verified (among ``drafted``)
    copy_accepted: int = 0     # ... and kept (among ``accepted``)
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    accepted_per_step: list[int] = field(default_factory=list)   # histogram source
    t_prefill: float = 0.0
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_inject: float = 0.0
    t_rollback: float = 0.0
    t_total: float = 0.0
    finish: str | None = None  # "stop" (EOS / stop token), "length", "context"

    # ------------------------------------------------------------------ recording
    def observe_step(self, drafted: int, accepted: int) -> None:
        """One step: ``drafted`` tokens proposed (0: a plain step), the first ``accepted`` of them kept."""
        self.passes += 1
        if drafted <= 0:
            return
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.accepted_per_step.append(accepted)
        grow = drafted - len(self.drafted_per_pos)
        if grow > 0:
            self.drafted_per_pos.extend([0] * grow)
            self.accepted_per_pos.extend([0] * grow)
        for i in range(drafted):
            self.drafted_per_pos[i] += 1
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def observe_copy(self, copied: int, accepted: int) -> None:
        """One of the steps :meth:`observe_step` counted was a copy of ``copied`` tokens, ``accepted`` kept."""
        self.copy_steps += 1
        self.copied += copied
        self.copy_accepted += accepted

    def merge(self, other: "GenerationStats") -> "GenerationStats":
        """Add ``other``'s counts, per-position counts and times to this one (in place); returns self."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name in ("drafted_per_pos", "accepted_per_pos"):
                a.extend([0] * (len(b) - len(a)))
                for i, x in enumerate(b):
                    a[i] += x
            elif f.name == "accepted_per_step":
                a.extend(b)
            elif f.name == "finish":
                self.finish = b if b is not None else a
            else:
                setattr(self, f.name, a + b)
        return self

    @classmethod
    def from_dict(cls, d: dict) -> "GenerationStats":
        """The counts and times of an :meth:`as_dict` record (per-position rates are not counts: left out)."""
        t = d.get("time") or {}
        return cls(n_prompt=int(d.get("n_prompt", 0)), n_reused=int(d.get("n_reused", 0)),
                   n_generated=int(d.get("n_generated", 0)), steps=int(d.get("steps", 0)), passes=int(d.get("passes", 0)),
                   drafted=int(d.get("drafted", 0)), accepted=int(d.get("accepted", 0)),
                   unverified=int(d.get("unverified", 0)), copy_steps=int(d.get("copy_steps", 0)),
                   copied=int(d.get("copied", 0)), copy_accepted=int(d.get("copy_accepted", 0)),
                   **{f"t_{p}": float(t.get(p, 0.0)) for p in PHASES + ("total",)})

    # ------------------------------------------------------------------ derived
    @property
    def tau(self) -> float:
        return acceptance_length(self.accepted, self.steps)

    @property
    def accept_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    @property
    def t_python(self) -> float:
        return max(0.0, self.t_total - sum(getattr(self, f"t_{p}") for p in PHASES))

    @property
    def t_decode(self) -> float:
        """Seconds after prompt processing (what tokens/s is measured over)."""
        return self.t_total - self.t_prefill

    @property
    def tokens_per_second(self) -> float:
        t = self.t_decode
        return self.n_generated / t if t > 0 else 0.0

    def phase_times(self) -> dict[str, float]:
        return {p: getattr(self, f"t_{p}") for p in PHASES + ("python",)}

    def as_dict(self) -> dict:
        return {
            "acceptance_length": round(self.tau, 4), "drafted": self.drafted, "accepted": self.accepted,
            "steps": self.steps, "passes": self.passes, "tokens_per_second": round(self.tokens_per_second, 2),
            "unverified": self.unverified,
            "copy_steps": self.copy_steps, "copied": self.copied, "copy_accepted": self.copy_accepted,
            "per_position_acceptance": [round(x, 4) for x in self.acceptance_rate_per_pos],
            "n_prompt": self.n_prompt, "n_reused": self.n_reused, "n_generated": self.n_generated,
            "time": {k: round(v, 6) for k, v in {**self.phase_times(), "total": self.t_total}.items()},
            "finish": self.finish,
        }
