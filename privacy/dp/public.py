"""DP-SGD's schedule from public values only: sampling rate, steps and normaliser.

Opacus derives all three from the length of the data it is given: q = 1 / ceil(n / B),
ceil(n / B) steps an epoch and the normaliser int(n q) (``PrivacyEngine.make_private``).
Under add/remove neighbours n is what differs between D and D', so the mechanism itself
changes with the private record count and its output reveals n, whatever the noise
(Opacus issue #819). fedpriv fixes the schedule from a size fixed before the data
instead:

* ``add-remove`` (default): a public size N (``dp-public-records``, or the run's expected
  partition size: the training rows of the configured dataset divided by the number of
  partitions, a function of the configuration). q = min(1, B / N), ceil(N / B) steps an
  epoch, normaliser q N = min(B, N). The client samples each of its actual records with
  probability q; adding or removing one changes nothing else, which is exactly the
  Poisson-subsampled Gaussian the accountants analyse.
* ``replace-one``: neighbours share n, so n itself is public and the same formulas use
  it (accounted with dp-accounting's PLD under ``REPLACE_ONE``).

The release then carries only values fixed by the configuration (steps, q, sigma), plus
the update. What the client reports as ``num-examples`` (FedAvg's weight) is N too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .accounting import RELATIONS


@dataclass(frozen=True)
class PublicSchedule:
    """The public parameters of one client's DP-SGD: ``records`` is N (see module doc)."""

    records: int
    batch_size: int
    relation: str = "add-remove"

    def __post_init__(self) -> None:
        if self.relation not in RELATIONS:
            raise ValueError(f"dp-relation must be one of {RELATIONS}, got {self.relation!r}")
        if self.records < 1 or self.batch_size < 1:
            raise ValueError(f"a DP-SGD schedule needs N >= 1 and B >= 1, got N = "
                             f"{self.records}, B = {self.batch_size}")

    @property
    def sample_rate(self) -> float:
        """Poisson rate q = min(1, B / N)."""
        return min(1.0, self.batch_size / self.records)

    @property
    def steps_per_epoch(self) -> int:
        """ceil(N / B): an epoch visits each record once in expectation."""
        return math.ceil(self.records / self.batch_size)

    @property
    def expected_batch_size(self) -> float:
        """The normaliser of the noisy sum: q N = min(B, N)."""
        return self.sample_rate * self.records


def schedule_for(relation: str, batch_size: int, public_records: int,
                 actual_records: int) -> PublicSchedule:
    """The schedule of a client: from the public size under add/remove, from its own n
    under replace-one (where n is public by the relation)."""
    n = actual_records if relation == "replace-one" else public_records
    return PublicSchedule(int(n), int(batch_size), relation)
