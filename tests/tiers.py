"""A pytest plugin that prints each collected test's tier, for tests/test_docs.py's check of docs/testing.md:

    PYTHONPATH=tests .venv/bin/python -m pytest --collect-only -q -p tiers -o addopts=

prints `tier: tests/FILE::NAME[PARAMETERS] TIER` for every test, TIER one of quick, full, slow (the markers of
pyproject.toml; the GPU tier's tests are quick-tier tests that need a GPU)."""


def pytest_collection_modifyitems(items):
    for item in items:
        marks = {mark.name for mark in item.iter_markers()}
        tier = "slow" if "slow" in marks else "full" if "full" in marks else "quick"
        print(f"tier: {item.nodeid} {tier}")
