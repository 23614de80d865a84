"""The toy-world learning proofs as data: what each one trains (a shell script, a preset, flags), what it is judged on
(held-out prompts x fixed seeds), and the bounds that every gated quantity must clear; and the CPU numeric paths
they are measured and run under.

tests/test_toy_learning*.py run each case once, on the pinned numeric path; tests/learning_spread.py runs each over
training seeds x numeric paths and reports how far every measured quantity sits from its bound, in units of its
spread (docs/learning_proofs.md). The rule: the mean clears each bound by at least 5 times its standard deviation
over 10 or more training seeds (x numeric paths); the cases' comments say which bounds do not meet it yet.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# CPU numeric paths. The same seed, weights and thread count compute other bits under another instruction set (ATen's
# vectorised kernels, oneDNN's convolutions, MKL's BLAS), and a training run amplifies that like another seed. Each
# path is three environment variables that must be set before torch first computes.
NUMERIC_PATHS: dict[str, dict[str, str]] = {
    # every x86-64 CPU that CI may run on has AVX2: the learning stage is pinned to it (conftest.py)
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2"},
    "native": {},  # whatever the CPU offers (AVX-512 where it has it)
    "baseline": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_CBWR": "COMPATIBLE"},
}
PINNED_PATH = "avx2"
NUMERIC_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR")


def numeric_env(path: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default os.environ) with the three numeric-path variables set to `path`'s (unset for native)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in NUMERIC_VARS}
    env.update(NUMERIC_PATHS[path])
    return env


def lora_digest(folder: Path) -> str:
    """sha256 of a saved LoRA's tensors (names and bytes, in name order), not of the file, whose header varies."""
    import torch
    from safetensors.torch import load_file

    from refl_ddpo.core.lora import LORA_WEIGHTS_NAME

    weights = load_file(str(Path(folder) / LORA_WEIGHTS_NAME))
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def describe_numeric_path() -> str:
    """One line: the three variables as this process sees them and the capability torch dispatches to."""
    import torch

    names = " ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in NUMERIC_VARS)
    return f"CPU numeric path: {names}; torch CPU capability {torch.backends.cpu.get_cpu_capability()}"


@dataclass(frozen=True)
class Case:
    """One learning proof. Gated, each against the base model on the same held-out prompts and seeds: the colour
    accuracy gain (>= min_gain), the drop of the grey fraction (<= max_grey_drop: the shapes did not grow to fill
    the frame), the rise of the dirty fraction (<= max_dirty_rise) and of ragged (<= max_ragged_rise: the shapes did
    not break into strokes)."""

    name: str
    script: str
    preset: str
    flags: tuple[str, ...]
    model: str  # a folder name under toy_world.DATA_DIR
    prompts: str  # the name of a prompt tuple in refl_ddpo.toy_world.world
    eval_seeds: str  # the name of a seed tuple in refl_ddpo.toy_world.world
    min_gain: float
    max_grey_drop: float | None  # None: not gated (a known reward hack; docs/record/learning_spread.md)
    max_dirty_rise: float | None
    max_ragged_rise: float | None

    def evaluate(self, lora_dir: Path | None = None) -> dict[str, float]:
        """Colour accuracy, dirty, grey and ragged of the held-out images, in this process."""
        from refl_ddpo.toy_world import world as toy_world

        return toy_world.evaluate_model(
            toy_world.DATA_DIR / self.model,
            lora_dir,
            getattr(toy_world, self.prompts),
            getattr(toy_world, self.eval_seeds),
        )

    @property
    def eval_key(self) -> tuple[str, str, str]:
        """Cases with the same key share one base evaluation."""
        return (self.model, self.prompts, self.eval_seeds)

    def train(
        self, out: Path, *extra: str, env: dict[str, str] | None = None, timeout: float | None = 900
    ) -> subprocess.CompletedProcess:
        """Run the case's shell script, weights to `out` (`timeout` seconds at most): one torch CPU thread, on the CPU
        unless `extra` names another --device."""
        env = {
            k: v
            for k, v in (os.environ if env is None else env).items()
            if k not in ("GPUS", "NUM_PROCESSES")
        }
        env.update(PYTHON=sys.executable, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        return subprocess.run(
            [
                "bash",
                f"train_scripts/{self.script}",
                "--preset",
                self.preset,
                "--output_dir",
                str(out),
                "--device",
                "cpu",
                "--report_to",
                "none",
                "--validation_prompts_file",  # the presets validate; the cases measure held-out accuracy themselves
                "none",
                *self.flags,
                *extra,
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def changes(self, base: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        """The four gated quantities, each signed so that larger is worse except the gain."""
        return {
            "gain": after["accuracy"] - base["accuracy"],
            "grey_drop": base["grey"] - after["grey"],
            "dirty_rise": after["dirty"] - base["dirty"],
            "ragged_rise": after["ragged"] - base["ragged"],
        }

    def check(self, base: dict[str, float], after: dict[str, float]) -> None:
        """Assert every bound; the message carries both evaluations and the numeric path."""
        c = self.changes(base, after)
        why = (self.name, base, after, describe_numeric_path())
        assert c["gain"] >= self.min_gain, ("colour accuracy gain", *why)
        for quantity, bound, what in (
            ("grey_drop", self.max_grey_drop, "the shapes grew (grey fell)"),
            ("dirty_rise", self.max_dirty_rise, "the images got dirty"),
            ("ragged_rise", self.max_ragged_rise, "the shapes broke up (ragged rose)"),
        ):
            assert bound is None or c[quantity] <= bound, (what, *why)


_SD_HELDOUT = {"model": "toy-sd", "prompts": "HELDOUT_PROMPTS", "eval_seeds": "PROOF_EVAL_SEEDS"}
_SD_GREEN = {"model": "toy-sd", "prompts": "PG_HELDOUT_PROMPTS", "eval_seeds": "PROOF_EVAL_SEEDS"}
_SD3_CYAN = {"model": "toy-sd3", "prompts": "SD3_HELDOUT_PROMPTS", "eval_seeds": "PROOF_EVAL_SEEDS"}
_SD3_GREEN = {"model": "toy-sd3", "prompts": "PG_HELDOUT_PROMPTS", "eval_seeds": "PROOF_EVAL_SEEDS"}

# The bounds: docs/record/learning_spread.md gives, for each case, the mean and standard deviation of every quantity over
# training seeds x numeric paths (10 or more distinct seeds), and how many of those standard deviations each bound lies
# from the mean. The rule is 5; a gain bound sits at the 5-std point where that point is above 0, and the shape
# bounds stay at 0.2 / 0.2 / 0.1 (larger would let a frame-filling or broken-up LoRA pass). Under the pinned path every
# case clears every bound on seed 42, the tests' seed; docs/learning_proofs.md says which bounds are under 5 today.
CASES: dict[str, Case] = {
    c.name: c
    for c in (
        # ReFL on toy-sd, the 6 held-out colour / shape combinations x 64 seeds. The preset (160 steps, toy_classifier
        # alone) gains +0.26 +- 0.08 there and its runs differ in how much the shapes grow; 320 steps with toy_clean
        # beside the classifier and ReFL's KL to the base at weight 1 gain more, and alike on every seed: +0.33 +- 0.03
        # over 10 seeds, whose 5-std point (+0.17) sets the gain bound
        Case(
            "refl",
            "train_refl_lora.sh",
            "toy_world",
            ("--max_train_steps", "320", "--reward", "toy_classifier:1,toy_clean:0.2", "--kl_weight", "1"),
            **_SD_HELDOUT,
            min_gain=0.15,
            max_grey_drop=0.2,
            max_dirty_rise=0.2,
            max_ragged_rise=0.1,
        ),
        # DRaFT-3: the whole 10-step run, gradient through the last 3 steps; 160 steps at lr 1e-3, toy_clean beside
        # the classifier, and the KL to the base over the 3 grad steps at weight 1 (80 steps on the classifier alone
        # gained +0.19 with std 0.07, and filled the frame on an AVX-512 Xeon: grey 0.766 -> 0.446; without the KL
        # the seeds grew the shapes or broke them up: gain +0.29 +- 0.06, grey drop and ragged rise 3.7 and 3.0 std
        # from their bounds; with it the gain is lower and steady, the shapes stay where the base draws them)
        Case(
            "draft3",
            "train_refl_lora.sh",
            "toy_world",
            (
                "--backprop_steps",
                "3",
                "--max_train_steps",
                "160",
                "--learning_rate",
                "1e-3",
                "--reward",
                "toy_classifier:1,toy_clean:0.2",
                "--kl_weight",
                "1",
            ),
            **_SD_HELDOUT,
            min_gain=0.05,
            max_grey_drop=0.2,
            max_dirty_rise=0.2,
            max_ragged_rise=0.1,
        ),
        # GRPO on toy-sd (DDIM log-prob step, the preset's toy_color_match + toy_clean), trained on the word green,
        # "a green triangle" x 64 seeds. Under the rule on its gain (2.9 std), grey drop (4.5) and ragged rise (0.8 std
        # over 30 seeds: 7 of them shrink the shapes past the bound; seed 42 does not): docs/learning_proofs.md
        Case(
            "grpo",
            "train_grpo.sh",
            "toy_world",
            (),
            **_SD_GREEN,
            min_gain=0.3,
            max_grey_drop=0.2,
            max_dirty_rise=0.2,
            max_ragged_rise=0.1,
        ),
        # toy-sd3, trained on the word cyan, "a cyan circle" x 64 seeds. DDPO trains on cyan's two prompts with two
        # magenta ones beside them that toy-sd3 already draws right (toy_world_cyan_anchored). On cyan's two alone a
        # LoRA can earn the reward by turning squares cyan rather than by the word: seed 9 did (squares 0.69 -> 1.00,
        # the held-out circle 0.23 -> 0.31), and over 11 seeds the gain cleared its bound by 2.0 std. With the
        # magenta square in the batch that route loses reward (seed 9 +0.75). Over 30 seeds the gain (3.3 std) and
        # ragged rise (3.4) are still under the rule, and seed 19 gains +0.22, under the bound; seed 42 is not. A
        # proof judging the mean of 3 seeds would meet it, at 2 more runs than the stage's time holds
        # (docs/record/learning_spread.md)
        Case(
            "ddpo_sd3",
            "train_ddpo.sh",
            "toy_world_sd3",
            ("--prompt_fn", "toy_world_cyan_anchored"),
            **_SD3_CYAN,
            min_gain=0.24,
            max_grey_drop=0.2,
            max_dirty_rise=0.2,
            max_ragged_rise=0.1,
        ),
        Case(
            "refl_sd3",
            "train_refl_lora.sh",
            "toy_world_sd3",
            (),
            **_SD3_CYAN,
            min_gain=0.4,
            max_grey_drop=0.2,
            max_dirty_rise=0.2,
            max_ragged_rise=0.1,
        ),
        # GRPO on toy-sd3 at 16 epochs, twice the preset's, with Flow-GRPO's KL to the base at 0.02. Without the KL the
        # runs' shapes drift, each seed its own way (ragged rise +0.014 +- 0.022 over 11 seeds, 3.9 std from its bound;
        # judged on 256 seeds it is the same); the KL at 0.02 holds them (+0.008 +- 0.013, 6.9) and the gain spreads
        # more (+0.66 +- 0.08; seed 42 +0.48), so its bound sits at +0.2, under its 5-std point (+0.28); at 0.04 seed 0
        # gains only +0.41. toy_clean in the reward shrinks the shapes
        Case(
            "grpo_sd3",
            "train_grpo.sh",
            "toy_world_sd3",
            ("--num_epochs", "16", "--kl_weight", "0.02"),
            **_SD3_CYAN,
            min_gain=0.2,
            max_grey_drop=0.2,
            max_dirty_rise=0.2,
            max_ragged_rise=0.1,
        ),
        # The forward-process proofs train toy-sd3 on the word green ("a green circle", "a green square"; judged on "a
        # green triangle" x 64 seeds) with a KL to the base at weight 1, not on the presets' cyan. toy-sd3 draws the
        # cyan training prompts cyan about 3 times in 4, the reward has little left to teach, and over 14 seeds some
        # hardly learned the colour (NFT +0.57 +- 0.18, AWM +0.52 +- 0.19: 0.4 and 1.2 std). It draws the green ones
        # green 1 time in 8: every seed learns (NFT 1.000 on 10 seeds), but without the KL the triangle grows
        # toward the training prompts' circle and square (grey drop +0.10 +- 0.03, 3.4 std). docs/record/learning_spread.md
        # DiffusionNFT: clean samples of the Euler sampler, the forward-process loss; over 12 seeds gain +0.68 +- 0.03
        # (7.0 std above the bound), grey drop +0.06 +- 0.02 (7.6). The trained weights, as the toy preset releases
        # them; released as the reference's EMA, seeds 0-4 gain +0.64 +- 0.03 (4.6 std: the EMA lags an epoch)
        Case(
            "nft_sd3",
            "train_nft.sh",
            "toy_world_sd3",
            ("--prompt_fn", "toy_world_green", "--kl_weight", "1"),
            **_SD3_GREEN,
            min_gain=0.5,
            max_grey_drop=0.2,
            max_dirty_rise=0.2,
            max_ragged_rise=0.1,
        ),
        # AWM: NFT's samples, the advantage-weighted matching loss, with toy_color_clean; over 12 seeds gain +0.58 +-
        # 0.05 (5.7 std above the bound), grey drop +0.04 +- 0.02 (10.4)
        Case(
            "awm_sd3",
            "train_awm.sh",
            "toy_world_sd3",
            ("--prompt_fn", "toy_world_green", "--kl_weight", "1", "--reward", "toy_color_clean"),
            **_SD3_GREEN,
            min_gain=0.3,
            max_grey_drop=0.2,
            max_dirty_rise=0.2,
            max_ragged_rise=0.1,
        ),
    )
}


# Guarded training (docs/guards.md): a case whose reward is hacked, run once with the guard's flags. The proxy is the
# colour reward alone, which the shapes can earn by growing until they fill the frame; the gold measure is toy_judge on
# the held-out prompt at its own seeds (--seed + j, not the evaluation's), every epoch, keeping the best weights in
# best/ while the run goes on (--early_stop_patience 0) and writes its last ones (--final_weights last). The case's
# bounds are the kept weights'; the last weights must break a shape bound (the hack the guard is there to catch).
GUARD_FLAGS = (
    "--reward",
    "toy_color_match",
    "--validation_prompts_file",
    "toy_world_green_heldout",
    "--validation_epochs",
    "1",
    "--num_validation_images",
    "16",
    "--validation_reward",
    "toy_judge",
    "--early_stop_metric",
    "validation/toy_judge/mean",
    "--final_weights",
    "last",
)
# DiffusionNFT on toy-sd (its toy preset, 16 epochs, the word green): over seeds 42 and 0-4 the last weights fill the
# frame on every seed (grey drop +0.31 to +0.58, mean +0.46 +- 0.12, 2.2 std past its bound); the kept weights meet
# every shape bound on 3 of the 6 and hold half the gain on 5 of the 6, both on 2 (seeds 42 and 1): under the rule, and
# said so in docs/learning_proofs.md. GRPO's toy preset on the same reward hacks on 3 of 6 seeds and keeps shapes
# inside the bounds on all 6 (docs/record/guards.md).
GUARDED: dict[str, Case] = {
    c.name: c
    for c in (
        Case(
            "nft_guard",
            "train_nft.sh",
            "toy_world",
            (*GUARD_FLAGS, "--num_epochs", "16"),
            **_SD_GREEN,
            min_gain=0.15,
            max_grey_drop=0.2,
            max_dirty_rise=0.2,
            max_ragged_rise=0.1,
        ),
    )
}


def check_guard(case: Case, base: dict[str, float], last: dict[str, float], kept: dict[str, float]) -> None:
    """The last weights are hacked (a shape bound broken) and the kept ones are not, with at least half of the last
    weights' colour gain (and the case's min_gain)."""
    hacked, guarded = case.changes(base, last), case.changes(base, kept)
    why = (case.name, base, last, kept, describe_numeric_path())
    assert hacked["grey_drop"] > case.max_grey_drop or hacked["ragged_rise"] > case.max_ragged_rise, (
        "the last weights are not hacked: nothing for the guard to catch",
        *why,
    )
    assert guarded["gain"] >= max(case.min_gain, 0.5 * hacked["gain"]), (
        "the kept weights lost the gain",
        *why,
    )
    case.check(base, kept)
