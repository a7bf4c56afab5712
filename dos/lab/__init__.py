"""The lab: benchmark harness, sweeps, records, checks, figures and the command line.

It imports the optimizer core (`dos`), never the other way round (tests/test_layout.py).
"""
