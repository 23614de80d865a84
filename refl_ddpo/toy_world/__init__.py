"""The toy world: coloured shapes on grey, tiny models trained to draw them, and a judge (world.py); the committed
weights checked against their SHA256SUMS (files.py). Importing the package loads no torch: presets read DATA_DIR."""

from pathlib import Path

DATA_DIR = (
    Path(__file__).resolve().parent / "data"
)  # the committed toy-sd, toy-sd3, classifier and SHA256SUMS
