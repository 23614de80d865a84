"""The benchmark of ReFL, DDPO and inference (`python benchmarks/bench.py`): config, model builders, cases,
measuring, FLOP floors, report and option sweep, one module each."""
