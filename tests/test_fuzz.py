"""A table of bad inputs: each must exit 2 (3 where the push itself fails) with a short message naming the key,
file, field or site, write nothing and delete nothing (docs/reliability.md). The table is split by what it feeds
the CLI, one test file each: tests/test_fuzz_config.py, test_fuzz_model.py, test_fuzz_data.py,
test_fuzz_rundir.py, test_fuzz_bundle.py, test_fuzz_push.py and test_fuzz_eval.py; this file checks the table as a
whole. The CLI functions run in-process; a real second process is used only where it is the point (a run holding
the lock, test_fuzz_rundir.py). The inputs and the check of a case are in tests/support/fuzz.py.

Cases that do not exit 2, covered elsewhere:
- SIGINT (130) or SIGTERM (143) during the capture, one line on the console and the traceback in run.log:
  tests/cli/test_exits.py::test_a_signal_during_the_capture_exits_with_its_status_one_line_and_the_traceback_in_run_log
- a stage file corrupted in place at the same size reruns its stage with one warning naming it:
  tests/calibration/test_stage_hashes.py::test_a_file_corrupted_in_place_at_its_size_reruns_its_stage_with_a_warning
- a failed stage (3) is the one that raised, never one an older record names:
  tests/calibration/test_pipeline_failures.py::test_the_console_names_the_stage_that_raised_not_a_stale_record
"""

from __future__ import annotations

import test_fuzz_bundle
import test_fuzz_config
import test_fuzz_data
import test_fuzz_eval
import test_fuzz_model
import test_fuzz_push
import test_fuzz_rundir
from support.fuzz import case_ids

CASES = [
    *test_fuzz_config.CASES,
    *test_fuzz_model.CASES,
    *test_fuzz_data.CASES,
    *test_fuzz_rundir.CASES,
    *test_fuzz_bundle.CASES,
    *test_fuzz_push.CASES,
    *test_fuzz_eval.CASES,
]


def test_the_table_is_large_enough():
    assert len(CASES) >= 40 and len(set(case_ids(CASES))) == len(CASES)
