"""simulations/make_test_time.py keeps pytest's failure sections, not only the log's tail."""

from __future__ import annotations

from conftest import load_tool


def _script():
    return load_tool("make_test_time", "simulations")


LOG = """\
........F.E.
==================================== ERRORS ====================================
____________ ERROR at teardown of test_cluster ____________
AssertionError: needed SIGKILL: [123]
=================================== FAILURES ===================================
____________ test_numbers ____________
AssertionError: 2 problem(s)
=============================== warnings summary ===============================
tests/test_x.py: 124 warnings
  DeprecationWarning: old
=========================== short test summary info ============================
FAILED tests/test_numbers.py::test_numbers - AssertionError: 2 problem(s)
1 failed, 9 passed, 1 error in 3.00s
"""


def test_failure_sections_keep_each_traceback_and_stop_at_the_warnings():
    mt = _script()
    text = mt.failure_sections(LOG)
    assert text.startswith("=" * 36 + " ERRORS")
    assert "needed SIGKILL: [123]" in text and "AssertionError: 2 problem(s)" in text
    assert "warnings summary" not in text and "DeprecationWarning" not in text
    assert mt.failure_sections("....\n10 passed in 1.00s\n") == ""
    cut = mt.failure_sections(LOG, limit=40)
    assert cut.endswith("[... cut]") and len(cut) == 40 + len("\n[... cut]")
    assert mt.pytest_summary(LOG) == {"failed": 1, "passed": 9, "error": 1}


DURATIONS_LOG = """\
........
============================= slowest 3 durations ==============================
649.10s call     tests/test_deploy.py::test_run
12.50s setup    tests/test_flwr_run.py::test_x
0.51s teardown tests/test_y.py::test_z
=========================== short test summary info ============================
8 passed in 700.00s
"""


def test_slowest_durations_are_kept_slowest_first():
    mt = _script()
    assert mt.slowest_durations(DURATIONS_LOG) == [
        {"seconds": 649.1, "when": "call", "test": "tests/test_deploy.py::test_run"},
        {"seconds": 12.5, "when": "setup", "test": "tests/test_flwr_run.py::test_x"},
        {"seconds": 0.51, "when": "teardown", "test": "tests/test_y.py::test_z"},
    ]
    assert mt.slowest_durations("8 passed in 1.00s") == []
