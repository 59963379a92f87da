"""Benchmarks of issue #6: the cost of a chat step and of the index, as ratios against bare runsc.

Run `python -m bench` (full) or `python -m bench --quick` (CI). See docs/benchmarks.md.
"""
