"""benchmarks/run.py at a tiny size, so it cannot rot. Checks outputs, not timings."""

import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import expecttest


RUN = Path(__file__).parent.parent / "benchmarks" / "run.py"


class BenchmarkSmokeTest(expecttest.TestCase):
    def test_tiny_run_writes_documented_outputs(self) -> None:
        with tempfile.TemporaryDirectory() as out:
            proc = subprocess.run(
                [sys.executable, str(RUN), "--sizes", "3", "--ranks", "1", "--repeats", "2",
                 "--eval-repeats", "1", "--checkpoint-repeats", "1", "--out", out],
                capture_output=True, text=True, timeout=600,
            )
            self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
            files = sorted(p.name for p in Path(out).iterdir())
            report = json.loads((Path(out) / "bench.json").read_text())
        result = report["results"]["ranks=1"]["N=4"]
        self.assertExpectedInline(
            "\n".join(
                [", ".join(files), ", ".join(sorted(report)), ", ".join(sorted(result)),
                 ", ".join(sorted(result["overhead_ratio"])),
                 ", ".join(sorted(result["overhead_ratio"]["get_optimizer_state_dict"])),
                 ", ".join(sorted(result["after_eval"]))]
            ),
            """\
bench.json, bench.md, overhead.png
command, machine, results, status, torch
after_eval, always_reshard_us_per_module, calls, checkpoint, fsdp_modules, noop_fraction_of_get_optimizer_state_dict, noop_us, noop_us_per_module, optim_params, overhead_ratio
checkpoint, get_optimizer_state_dict, get_state_dict, set_optimizer_state_dict
median, p25, p75
get_optimizer_state_dict_ms, get_optimizer_state_dict_ratio_to_noop_path, next_forward_us_after_reshard, next_forward_us_root_unsharded, reshard_us, reshard_us_per_module""",
        )


if __name__ == "__main__":
    unittest.main()
