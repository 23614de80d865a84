"""The maths of the trainers as pure functions: losses, advantages, statistics (no models, no I/O)."""
