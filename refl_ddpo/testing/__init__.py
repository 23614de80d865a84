"""Test and demo support, kept out of the library: no module of refl_ddpo outside this package imports it
(tests/test_layout.py checks).

    tiny.py          tiny random SD 1.x / SD3 pipelines and `python -m refl_ddpo.testing.tiny OUT` (every tiny model
                     in the checkpoint/ layout; the toy world with --toy_world)
    tiny_flux.py     tiny random FLUX.1 folders (dev-like and schnell-like), written by tiny.py
    tiny_qwen.py     a tiny random Qwen-Image folder, written by tiny.py
    tiny_zimage.py   tiny random Z-Image folders (base-like and Turbo-like), written by tiny.py
    tiny_flux2.py    tiny random FLUX.2 [dev] and [klein] (distilled, base) folders, written by tiny.py
    tiny_parts.py    what the builders share: SD's scheduler settings, offline CLIP / T5 tokenizers, a tiny CLIP config
    tiny_rewards.py  tiny random reward models (ImageReward, aesthetic, PickScore / CLIP score, HPSv2, BERTScore's BERT)
    toy_train.py     the toy world's models and their training loops
    toy_build.py     `python -m refl_ddpo.testing.toy_build OUT`: the toy world trained from scratch (25-30 CPU minutes)

`python -m refl_ddpo.tiny OUT` (refl_ddpo/tiny.py, a shim) and the `refl-ddpo-tiny` command run testing.tiny's main.
"""
