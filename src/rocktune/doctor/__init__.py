"""``rocktune doctor``: correctness self-tests on the device, each a small function -> CheckResult.

checks.py / model_checks.py / perf.py hold the checks, registry.py names them, child.py runs them in a child
process (so a GPU fault fails one check instead of killing the doctor), runner.py drives the child, main.py ties
platform snapshot, advice and checks together, render.py prints them.
"""
