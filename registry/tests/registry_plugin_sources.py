"""Sources of throw-away plugins the registry tests install as real distributions."""

GOOD = """
from phalanx_core import CollectiveSpec, StrategySpec, hookimpl

@hookimpl
def phalanx_collectives():
    return [CollectiveSpec(name="echo", target="{pkg}.impl:Echo", summary="echo")]

@hookimpl
def phalanx_strategies():
    return [StrategySpec(name="{pkg}_strategy", target="{pkg}.impl:Strat", summary="s")]
"""

RAISES_ON_IMPORT = """
raise RuntimeError("this plugin is broken on purpose")
"""

SYNTAX_ERROR = """
def phalanx_collectives(:
    pass
"""

HOOK_RAISES = """
from phalanx_core import hookimpl

@hookimpl
def phalanx_collectives():
    raise ValueError("hook failed on purpose")
"""

WRONG_TYPE = """
from phalanx_core import hookimpl

@hookimpl
def phalanx_collectives():
    return "echo"
"""

WRONG_SPEC_KIND = """
from phalanx_core import StrategySpec, hookimpl

@hookimpl
def phalanx_collectives():
    return [StrategySpec(name="oops", target="x.y:Z")]
"""

MISSPELT = """
from phalanx_core import CollectiveSpec, hookimpl

@hookimpl
def phalanx_colectives():
    return [CollectiveSpec(name="never", target="x.y:Z")]
"""

BAD_TARGET = """
from phalanx_core import CollectiveSpec, hookimpl

@hookimpl
def phalanx_collectives():
    return [
        CollectiveSpec(name="nomodule", target="does_not_exist_anywhere.mod:Thing"),
        CollectiveSpec(name="noattr", target="{pkg}:Missing"),
        CollectiveSpec(name="needsit", target="{pkg}:Missing", needs=("no_such_backend_pkg",),
                       install="pip install no-such-backend"),
    ]
"""

# A complete world-of-one collective, written as a third party would.
ECHO_IMPL = """
from phalanx_core import Collective, Strategy

class Echo(Collective):
    name = "echo"
    unsupported = frozenset({
        "barrier", "broadcast", "all_reduce", "reduce", "all_gather", "gather", "scatter",
        "reduce_scatter", "all_to_all", "send", "recv", "broadcast_object",
        "all_gather_object", "gather_object", "scatter_object",
    })

    def setup(self, environment, accelerator=None):
        self._up = True

    def teardown(self):
        self._up = False

    @property
    def is_initialized(self):
        return getattr(self, "_up", False)

    @property
    def rank(self):
        return 0

    @property
    def world_size(self):
        return 1

    def new_group(self, ranks):
        return self

class Strat(Strategy):
    pass
"""
