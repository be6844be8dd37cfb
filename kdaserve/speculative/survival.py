"""What the Speculator knows of its drafts' chances: each draft's survival (the chance that it
and every draft before it are accepted), the typical survival by position that the schedule
plans with, and the record of verifies that calibrates both.

A drafter with its own estimates (DSpark's confidence head) has them calibrated against what
verification keeps: by position, (kept + CALIBRATION_PRIOR) / (predicted + CALIBRATION_PRIOR)
over recent verified drafts (each past one weighted CALIBRATION_DECAY per new one: ~500 of
memory). The trained DSpark's confidences were measured optimistic (GSM8K target, K = 4,
batch 16: predicted survival 0.87 0.75 0.64 0.54 by position, kept 0.82 0.65 0.53 0.45), and
the schedule then verified drafts that cost more than they returned (0.93-0.98x plain
decoding at batch 16). A drafter without estimates gets this engine's record by position.
"""

from __future__ import annotations

SURVIVAL_EMA = 0.2  # weight of the newest proposal in the typical survival by position
CALIBRATION_PRIOR = 8.0
CALIBRATION_DECAY = 0.998


class SurvivalRecord:
    def __init__(self) -> None:
        self.typical: list[float] = []  # recent proposals' mean survival by position
        self.typical_version = 0  # bumped when `typical` changes
        # per draft position i: verifies that drafted it, and that kept it (and all before)
        self.drafted_at: list[int] = []
        self.accepted_at: list[int] = []
        # per position, decayed sums over verified drafts of the drafter's own survival
        # estimate and of the outcome (1 if kept): its calibration
        self.predicted_sum: list[float] = []
        self.kept_sum: list[float] = []

    def estimate(self, k: int, own: list[float] | None) -> list[float]:
        """The chance each of k drafts survives: the drafter's own estimate (`own`) where it
        has one, calibrated, else this engine's record by position, optimistic (one kept
        verify assumed: an unseen position is tried before it is judged, else a drafter that
        starts in a large batch would never get a record)."""
        out, p = [], 1.0
        if own is not None:
            for i, x in enumerate(own[:k]):
                p = min(p, x * self.calibration(i))
                out.append(p)
            return out
        for i in range(k):
            seen = self.drafted_at[i] if i < len(self.drafted_at) else 0
            kept = self.accepted_at[i] if i < len(self.accepted_at) else 0
            p = min(p, (kept + 1) / (seen + 1))
            out.append(p)
        return out

    def calibration(self, i: int) -> float:
        """What to multiply the drafter's survival estimate at position i by (1 until
        verifies show otherwise)."""
        pred = self.predicted_sum[i] if i < len(self.predicted_sum) else 0.0
        kept = self.kept_sum[i] if i < len(self.kept_sum) else 0.0
        return (kept + CALIBRATION_PRIOR) / (pred + CALIBRATION_PRIOR)

    def calibrate(self, own: list[float], accepted: int) -> None:
        """A verify of drafts the drafter gave survival `own`, of which `accepted` were kept."""
        d = CALIBRATION_DECAY
        for i, x in enumerate(own):
            if i == len(self.predicted_sum):
                self.predicted_sum.append(0.0)
                self.kept_sum.append(0.0)
            self.predicted_sum[i] = d * self.predicted_sum[i] + x
            self.kept_sum[i] = d * self.kept_sum[i] + (i < accepted)

    def verified(self, num_drafts: int, accepted: int, own: list[float] | None) -> None:
        """A request verified num_drafts drafts and kept `accepted`."""
        if own is not None:
            self.calibrate(own[:num_drafts], accepted)
        while len(self.drafted_at) < num_drafts:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(num_drafts):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted

    def observe(self, survival: list[list[float]]) -> None:
        """Folds a proposal's mean survival by position into `typical` (positions this
        proposal did not reach keep their value)."""
        self.typical_version += 1
        for i in range(max(map(len, survival), default=0)):
            at = [s[i] for s in survival if len(s) > i]
            mean = sum(at) / len(at)
            if i < len(self.typical):
                self.typical[i] = (1 - SURVIVAL_EMA) * self.typical[i] + SURVIVAL_EMA * mean
            else:
                self.typical.append(mean)
