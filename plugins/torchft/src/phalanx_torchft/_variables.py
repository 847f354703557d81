"""The variables a rank of a ``ddp_ft`` job reads: which replica group it
is in, how many there are, and where the lighthouse is. Imports no torch."""

from __future__ import annotations

import os

from phalanx_core import MisconfigurationError

#: This process's replica group (0 .. N-1); set by launcher 'replica_groups'.
REPLICA_GROUP_VAR = "PHALANX_REPLICA_GROUP"
#: How many replica groups the job has.
REPLICA_GROUPS_VAR = "PHALANX_REPLICA_GROUPS"
#: The fewest groups a step may have (the launcher's ``min_replicas``).
MIN_REPLICAS_VAR = "PHALANX_MIN_REPLICAS"
#: A file that exists once the job has finished (a group ended its script):
#: a group that gets a quorum after that stops (launcher 'replica_groups').
FINISHED_FILE_VAR = "PHALANX_JOB_FINISHED"
#: A file a rank creates at its first committed step: the launcher then
#: knows that the job trains, and a group that fails is a restart's to fix.
COMMITTED_FILE_VAR = "PHALANX_JOB_COMMITTED"
#: Where a group's launching process writes the traceback of the rank that
#: failed first (the launcher compares the groups' failures).
GROUP_FAILURE_FILE_VAR = "PHALANX_GROUP_FAILURE"
#: The address of this host that the other hosts reach: where TorchFT's
#: peers reach a group's manager (several hosts).
GROUP_ADDRESS_VAR = "PHALANX_GROUP_ADDRESS"
#: TorchFT's own variable: the lighthouse's URL.
LIGHTHOUSE_VAR = "TORCHFT_LIGHTHOUSE"
#: The names TorchFT's examples use where torchrun starts each group.
TORCHFT_GROUP_VARS = ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS")


def replica_group_of_this_process(asked: str) -> tuple[int, int]:
    """``(group, groups)`` from phalanx's variables, or TorchFT's examples'
    where phalanx's are not set; a clear error where neither is."""
    for group_var, groups_var in ((REPLICA_GROUP_VAR, REPLICA_GROUPS_VAR), TORCHFT_GROUP_VARS):
        group, groups = os.environ.get(group_var), os.environ.get(groups_var)
        if group is None and groups is None:
            continue
        try:
            numbers = int(group or ""), int(groups or "")
        except ValueError:
            numbers = (-1, 0)
        if not 0 <= numbers[0] < numbers[1]:
            raise MisconfigurationError(
                f"{asked}: {group_var}={group!r} and {groups_var}={groups!r} do not name a replica "
                f"group: expected 0 <= {group_var} < {groups_var}"
            )
        return numbers
    raise MisconfigurationError(
        f"{asked}: this process is in no replica group ({REPLICA_GROUP_VAR} and "
        f"{REPLICA_GROUPS_VAR} are not set); start the script with phalanx run --strategy ddp_ft "
        "--replica-groups N, or, where torchrun starts each group, set REPLICA_GROUP_ID and "
        "NUM_REPLICA_GROUPS as TorchFT's examples do"
    )


def min_replicas() -> int:
    """The fewest groups a step may have: what the launcher was given, else 1."""
    text = os.environ.get(MIN_REPLICAS_VAR, "1")
    if not text.isdigit() or int(text) < 1:
        raise MisconfigurationError(f"{MIN_REPLICAS_VAR}={text!r}: expected an int of at least 1")
    return int(text)
