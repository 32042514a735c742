"""tests/gpu: each failure's report is printed as soon as the test fails, not only in pytest's summary at the end,
and each test that takes over :data:`SLOW_S` seconds is named when it ends. launch/gpu_check.sh runs these tests
under a time limit: a run cut off there (or killed in a hung CUDA call, which no signal interrupts) still shows why
the tests before the cut failed and where the time went. Nothing happens on a machine without CUDA (all skipped)."""
from __future__ import annotations

import pytest

SLOW_S = 10.0
_config = None


def pytest_configure(config) -> None:
    global _config
    _config = config


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report) -> None:
    reporter = _config and _config.pluginmanager.get_plugin("terminalreporter")   # registered after this conftest
    if not reporter:
        return
    if report.failed:
        reporter.write_line("")
        reporter.write_sep("_", f"FAILED {report.nodeid} ({report.when}, {report.duration:.1f} s)", red=True)
        reporter.write_line(report.longreprtext)
    elif report.when == "call" and report.duration >= SLOW_S:
        reporter.write_line(f"\n[slow] {report.nodeid}: {report.duration:.1f} s")
