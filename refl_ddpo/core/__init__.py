"""The core every trainer and app stands on: model families and their steps, the one denoising loop, LoRA, model
loading, prompt sources, images. It imports nothing from run/, trainers/, apps/ or testing/ (tests/test_layout.py)."""
