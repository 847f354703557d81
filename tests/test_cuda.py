"""Every torch strategy trains on a GPU in every precision, by name.

Each run is tests/cuda_run.py as a program: one rank on ``cuda:0``, 20
steps, a checkpoint saved and loaded back. Skipped where torch sees no CUDA
device (CI has none); run on a lent GPU machine with
``pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phalanx_core.testing.processes import scheduler_free_environment

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU"),
]

SCRIPT = Path(__file__).resolve().parent / "cuda_run.py"
STRATEGIES = ["single_device", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "fsdp", "manual"]
#: precision: (parameter dtype, output dtype under the forward context)
PRECISIONS = {
    "32-true": ("torch.float32", "torch.float32"),
    "64-true": ("torch.float64", "torch.float64"),
    "16-mixed": ("torch.float32", "torch.float16"),
    "bf16-mixed": ("torch.float32", "torch.bfloat16"),
    "16-true": ("torch.float16", "torch.float16"),
    "bf16-true": ("torch.bfloat16", "torch.bfloat16"),
}


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_trains_on_the_gpu_in_every_precision(strategy, precision, tmp_path):
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), strategy, precision, str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=scheduler_free_environment(),
        cwd=tmp_path,
    )
    assert done.returncode == 0, f"{strategy} {precision}: exit {done.returncode}\n{done.stderr[-6000:]}"
    result = json.loads(out.read_text())
    assert result["finite"], result
    assert result["last"] < result["first"] / 2, result
    assert (result["param_dtype"], result["out_dtype"]) == PRECISIONS[precision]
    assert result["param_device"] == "cuda"
    assert result["backend"] == (None if strategy == "single_device" else "nccl")
    assert result["loaded_same_weights"], result
    assert result["loaded_rest"] == ["step"]
    assert result["background_same_weights"] is (None if strategy == "manual" else True), result
    if result["checkpoint_keys"] is not None:  # fsdp writes a directory of shards
        expected = {"model", "optimizer", "step"} | ({"precision"} if precision == "16-mixed" else set())
        assert set(result["checkpoint_keys"]) == expected
