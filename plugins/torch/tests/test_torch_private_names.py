"""The private names of torch that phalanx-torch uses, each checked against
the torch installed, so that a release that renames or reshapes one fails
here, by name, rather than in a job. The launcher's are listed in
``_launch.agent.PRIVATE_AGENT_NAMES`` (all used in that module); the others
are one a module. CI runs this file on each end of the supported range."""

from __future__ import annotations

import inspect

import pytest
import torch.distributed as dist
from torch.distributed.elastic.agent.server import api as agent_api
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.launcher import api as launcher_api

from phalanx_torch._launch.agent import PRIVATE_AGENT_NAMES


def parameters(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


def source(function: object) -> str:
    return inspect.getsource(function)  # type: ignore[arg-type]


def test_every_private_agent_name_has_a_check():
    assert set(PRIVATE_AGENT_NAMES) == set(CHECKS)


def check_launch_agent_makes_the_module_global():
    # Read at call time from the module's globals: swapping it swaps the agent.
    assert launcher_api.LocalElasticAgent is LocalElasticAgent
    assert "LocalElasticAgent(" in source(launcher_api.launch_agent)


def check_monitor_workers():
    assert parameters(LocalElasticAgent._monitor_workers) == ["self", "worker_group"]
    assert "self._monitor_workers(" in source(agent_api.SimpleElasticAgent._invoke_run)


def check_rendezvous():
    assert parameters(agent_api.SimpleElasticAgent._rendezvous) == ["self", "worker_group"]
    assert "self._rendezvous(" in source(agent_api.SimpleElasticAgent._initialize_workers)


def check_restart_workers():
    assert parameters(agent_api.SimpleElasticAgent._restart_workers) == ["self", "worker_group"]
    assert "self._restart_workers(" in source(agent_api.SimpleElasticAgent._invoke_run)


def check_exit_barrier():
    assert parameters(agent_api.SimpleElasticAgent._exit_barrier) == ["self"]
    assert "self._exit_barrier()" in source(agent_api.SimpleElasticAgent._invoke_run)


def check_remaining_restarts():
    # The loop decides a restart from it and takes one off before each.
    run = source(agent_api.SimpleElasticAgent._invoke_run)
    assert "if self._remaining_restarts > 0:" in run and "self._remaining_restarts -= 1" in run


def check_pcontext():
    # The ranks' processes (elastic's PContext), whose close() stops them.
    assert "self._pcontext = start_processes(" in source(LocalElasticAgent._start_workers)
    from torch.distributed.elastic.multiprocessing.api import PContext

    assert parameters(PContext.close)[:1] == ["self"]


CHECKS = {
    "launcher.api.LocalElasticAgent": check_launch_agent_makes_the_module_global,
    "_monitor_workers": check_monitor_workers,
    "_rendezvous": check_rendezvous,
    "_restart_workers": check_restart_workers,
    "_exit_barrier": check_exit_barrier,
    "_remaining_restarts": check_remaining_restarts,
    "_pcontext": check_pcontext,
}


@pytest.mark.parametrize("name", sorted(PRIVATE_AGENT_NAMES))
def test_the_agents_private_name_is_as_the_launcher_uses_it(name):
    CHECKS[name]()


def test_the_default_store_of_the_default_group():
    # _collective.torch_collective (the group's store address) and process_group.
    assert parameters(dist.distributed_c10d._get_default_store) == []


def test_sync_module_states():
    # fsdp.py: FSDP's own broadcast of rank 0's module states.
    from torch.distributed.utils import _sync_module_states

    assert parameters(_sync_module_states)[:4] == ["module", "process_group", "broadcast_bucket_size", "src"]


def test_nccl_premul_sum():
    # _torch_versions: NCCL's pre-multiplied sum (a ReduceOp made with a factor).
    assert callable(dist._make_nccl_premul_sum)
