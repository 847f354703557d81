"""The contracts every phalanx collective keeps, run on this one.

- CollectiveSuite: every operation, dtypes, in-place results, reduce ops,
  subgroups, object collectives, async handles and a timeout, in worlds of
  1 to 3 ranks; and the fault-tolerance capabilities it declares
  (reconfigured to 3, 2 and 3 members with the contract after each, a
  member killed in an operation).
- TrafficSuite: DDP, FSDP and a user's own DDP under ``manual`` train
  through this collective (the suite counts the bytes each operation got)
  and reach the weights of the same steps computed in one process.
"""

from phalanx.testing.suites import CollectiveSuite, TrafficSuite


class TestCountingCollective(CollectiveSuite):
    collective = "counting"  # or the qualified name, "phalanx-counting:counting"


class TestCountingTraffic(TrafficSuite):
    collective = "counting"
