"""benchmarks/ops.py (`bench.py --ops_only`): the op counter counts a network call's kernels and casts, and the
counts per context of the tiny SD 1.x (the real SD v1.5's stand-in: the same blocks, fewer of them; the real one
takes a minute) stay at the baseline pinned in tests/fixtures/ops_sd15_tiny.json, so that a change that adds ops
names the op and the line that grew. After a change that is meant to move them, write the baseline
again: `REFL_DDPO_WRITE_OPS_BASELINE=1 pytest -n 0 tests/test_ops.py`."""

import json
import os
from pathlib import Path

import pytest
import torch

from benchmarks.config import BenchConfig
from benchmarks.ops import CONTEXTS, OpCount, family_records, ops_config, ops_table
from refl_ddpo.core.errors import UserError
from refl_ddpo.run.flags import parse_config

BASELINE = Path(__file__).resolve().parent / "fixtures" / "ops_sd15_tiny.json"


def test_counter_counts_kernels_and_casts_of_one_call():
    """A bf16 linear with an fp32 side weight under CUDA's autocast (emulated): the call's kernels (two casts,
    two matmuls, one add), views and the ops outside the call not counted; a second call without an outer
    autocast region casts the fp32 weight again."""
    from benchmarks.meta import cuda_on_meta

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base = torch.nn.Linear(8, 8, bias=False).to(torch.bfloat16)
            self.side = torch.nn.Parameter(torch.zeros(8, 8))

        def forward(self, x):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return self.base(x) + x.t().t() @ self.side

    with torch.device("meta"):
        net = Net()
    with cuda_on_meta(), OpCount() as count:
        x = torch.zeros(2, 8, device="meta", dtype=torch.bfloat16)
        x + 1  # not in a call
        count.watch(net)
        net(x)
        net(x)
    first, second = count.calls
    assert (first.kernel_ops, first.casts) == (4, 1)  # cast of side, mm, mm, add
    assert (second.kernel_ops, second.casts) == (4, 1)
    assert all(site.split(":")[0].endswith("tests/test_ops.py") for _, site in first.ops)


def test_ops_only_flags():
    cfg = parse_config(BenchConfig, ["--ops_only", "--ops_families", "sd15", "--ops_contexts", "refl_grad"])
    assert cfg.ops_only and cfg.ops_families == ["sd15"] and cfg.ops_contexts == ["refl_grad"]
    with pytest.raises(UserError, match="--ops_families sd2"):
        parse_config(BenchConfig, ["--ops_only", "--ops_families", "sd2"])


def _sites(record: dict) -> dict[str, int]:
    return {f"{s['op']} {s['site']}": s["count"] for s in record["top_sites"]}


def test_tiny_sd_counts_stay_at_the_baseline(tmp_path):
    """Every context of the tiny SD 1.x (meta device, bf16 with CUDA autocast): ops and casts per network call
    equal to the baseline's; a difference names the op sites (op, file:line) that moved."""
    from benchmarks.models import model_configs

    cfg = ops_config(BenchConfig(tiny=True))
    configs = model_configs(True, tmp_path)
    records = family_records(cfg, configs, tmp_path, "sd15", list(CONTEXTS))
    got = {r["context"]: r for r in records}
    if os.environ.get("REFL_DDPO_WRITE_OPS_BASELINE"):
        BASELINE.write_text(json.dumps(records, indent=1) + "\n")
    print(ops_table(records))
    for want in json.loads(BASELINE.read_text()):
        have = got[want["context"]]
        grown = {
            k: (v, _sites(want).get(k, 0)) for k, v in _sites(have).items() if v != _sites(want).get(k, 0)
        }
        assert (have["kernel_ops"], have["casts"]) == (want["kernel_ops"], want["casts"]), (
            f"{want['context']}: ops {want['kernel_ops']} -> {have['kernel_ops']}, casts {want['casts']} -> "
            f"{have['casts']}; op sites now (count, baseline): {grown}"
        )
