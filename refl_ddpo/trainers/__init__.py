"""Trainers: ReFL (refl.py) and DDPO (ddpo.py), each a `python -m` entry point on the shared core."""
