"""pytest plugin (-p printfail): print a failed test's report at once, before a CUDA abort at teardown can lose it."""


def pytest_runtest_logreport(report):
    if report.failed:
        print("\n=== FAILED", report.nodeid, report.when, "\n", report.longreprtext[-6000:], flush=True)
