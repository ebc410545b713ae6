import pytest


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keeps each phase's report on the test, for fixtures that look at it."""
    report = yield
    setattr(item, "rep_" + report.when, report)
    return report
