"""Stochastic sampler steps with log-probabilities: the exact maths, each with its source."""
