"""The apps on the core: before/after inference (inference/*.py) and the paired comparison of two runs."""
