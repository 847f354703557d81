"""The contract every phalanx collective keeps, run on this one: every
operation, dtypes, in-place results, reduce ops, subgroups, object
collectives, async handles and a timeout, in worlds of 1 to 3 ranks."""

from phalanx_core.testing.suites import CollectiveSuite


class TestCountingCollective(CollectiveSuite):
    collective = "counting"  # or the qualified name, "phalanx-counting:counting"
