"""Run under `phalanx run --option ...`: print what the script can read of the plan."""

import sys

import phalanx

code = {}
for arg in sys.argv[1:]:
    name, value = arg.split("=", 1)
    code[name] = value == "True"
strategy = phalanx.resolve(**code)
strategy.launch()
options = dict(strategy.plan.options)
print(
    f"rank={strategy.global_rank} plan={strategy.plan.strategy.name} options={options} "
    f"flags={phalanx.run_flags().get('options')}",
    flush=True,
)
