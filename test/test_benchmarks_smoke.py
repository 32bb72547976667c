"""benchmarks/run.py at a tiny size, so it cannot rot. Checks outputs, not timings."""

import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import expecttest
import pytest


pytestmark = [pytest.mark.ranks, pytest.mark.tooling]


RUN = Path(__file__).parent.parent / "benchmarks" / "run.py"


class BenchmarkSmokeTest(expecttest.TestCase):
    def test_tiny_run_writes_documented_outputs(self) -> None:
        with tempfile.TemporaryDirectory() as out:
            proc = subprocess.run(
                [sys.executable, str(RUN), "--sizes", "3", "--ranks", "1", "--repeats", "2",
                 "--eval-repeats", "1", "--checkpoint-repeats", "1", "--llm-dim", "16",
                 "--llm-blocks", "2", "--llm-ranks", "1", "--out", out],
                capture_output=True, text=True, timeout=600, check=False,
            )
            self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
            files = sorted(p.name for p in Path(out).iterdir())
            report = json.loads((Path(out) / "bench.json").read_text())
        layers = report["results"]["ranks=1"]["N=4"]
        lm = report["results"]["ranks=1"]["lm"]
        self.assertExpectedInline(
            "\n".join(
                [", ".join(files), ", ".join(sorted(report)), ", ".join(sorted(layers)),
                 ", ".join(sorted(layers["mechanism_us_per_fsdp_module"])),
                 ", ".join(sorted(layers["calls"])),
                 ", ".join(sorted(layers["calls"]["get_optimizer_state_dict"]["ratio"])),
                 ", ".join(sorted(layers["after_eval"])),
                 ", ".join(sorted(lm)), ", ".join(sorted(lm["after_eval"])),
                 f"layers: {layers['fsdp_modules']} FSDP modules, {layers['modules']} modules",
                 f"lm: {lm['fsdp_modules']} FSDP modules, {lm['modules']} modules"]
            ),
            """\
bench.json, bench.md, overhead.png
command, machine, results, status, torch
after_eval, calls, fix_to_plain_loop, fsdp_modules, mechanism_us_per_fsdp_module, modules, params, series_fraction_of_get_optimizer_state_dict, series_us
fix, optim_check, plain_loop, state_dict
get_optimizer_state_dict, get_state_dict, set_optimizer_state_dict
median, p25, p75
get_optimizer_state_dict_ms, get_optimizer_state_dict_ratio_to_nothing_unsharded, next_forward_us_after_reshard, next_forward_us_root_unsharded, reshard_us
after_eval, checkpoint, fix_to_plain_loop, fsdp_modules, mechanism_us_per_fsdp_module, modules, params, series_fraction_of_checkpoint, series_us
checkpoint_ms, checkpoint_ratio_to_nothing_unsharded
layers: 4 FSDP modules, 6 modules
lm: 3 FSDP modules, 29 modules""",
        )

if __name__ == "__main__":
    unittest.main()
