"""Advantages from several rewards and from pairs: GDPO (--reward_aggregation gdpo) and Pref-GRPO's win rates
(--pairwise_reward) against closed forms on fixed rewards and verdicts, the toy world's pairwise judge, the config's
one-line refusals, and GRPO on the toy world with two rewards under gdpo and with the toy judge, each curve logged.
CPU, the committed toy world."""

import math

import pytest
import torch
from helpers import watch_training

from refl_ddpo.algorithms.multi_reward import gdpo_advantages, judged_pairs, opponents, win_rates
from refl_ddpo.algorithms.policy import group_advantages
from refl_ddpo.core.errors import UserError
from refl_ddpo.rewards.pairwise import build_pairwise, group_win_rates, parse_pairwise_spec
from refl_ddpo.run.flags import parse_config
from refl_ddpo.toy_world import world as toy_world
from refl_ddpo.trainers.forward_config import NFTConfig
from refl_ddpo.trainers.grpo_config import GRPOConfig


def _std(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


# ---- GDPO ----


def test_gdpo_is_each_reward_normalised_in_its_group_then_the_weighted_sum_over_the_epoch():
    """Two rewards of very different spread in two interleaved groups, by hand: per reward and group (r - mean) /
    std, weighted, summed, then (c - mean) / std over all samples; the weighted sum's group advantages differ (the
    wide reward decides them alone)."""
    wide = [10.0, -10.0, 30.0, 0.0, 20.0, -30.0]
    narrow = [0.1, 0.3, 0.0, 0.2, 0.2, 0.1]
    groups = [0, 1, 0, 1, 0, 1]
    weights = [1.0, 2.0]
    normed = []
    for r in (wide, narrow):
        out = [0.0] * 6
        for g in (0, 1):
            members = [i for i in range(6) if groups[i] == g]
            values = [r[i] for i in members]
            m, s = sum(values) / len(values), max(_std(values), 1e-6)
            for i in members:
                out[i] = (r[i] - m) / s
        normed.append(out)
    combined = [weights[0] * a + weights[1] * b for a, b in zip(*normed, strict=True)]
    mean, std = sum(combined) / 6, _std(combined)
    expected = torch.tensor([(c - mean) / std for c in combined], dtype=torch.float64)
    got = gdpo_advantages(torch.tensor([wide, narrow]), torch.tensor(weights), torch.tensor(groups), 5.0)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), expected, atol=1e-6), (got, expected)
    summed = torch.tensor(wide) + 2 * torch.tensor(narrow)
    plain = group_advantages(summed, torch.tensor(groups), False, 5.0)
    assert not torch.allclose(plain, got, atol=1e-2)
    # clipped, and a reward equal within its groups adds nothing
    assert (
        gdpo_advantages(torch.tensor([wide]), torch.tensor([1.0]), torch.tensor(groups), 0.5).abs().max()
        == 0.5
    )
    flat = torch.tensor([wide, [1.0] * 6])
    alone = gdpo_advantages(torch.tensor([wide]), torch.tensor([1.0]), torch.tensor(groups), 5.0)
    assert torch.allclose(gdpo_advantages(flat, torch.tensor([1.0, 3.0]), torch.tensor(groups), 5.0), alone)


# ---- win rates ----


def test_win_rates_are_the_mean_verdict_over_each_samples_opponents():
    """A group of 3 and a group of 2, every pair judged once: P(0 beats 1) 1, P(0 beats 2) 0.5, P(1 beats 2) 0,
    P(3 beats 4) 0.25 give win rates (1 + 0.5) / 2, (0 + 0) / 2, (0.5 + 1) / 2, 0.25, 0.75."""
    groups = torch.tensor([0, 0, 0, 1, 1])
    chosen = opponents(groups)
    same = groups[:, None] == groups[None, :]
    assert torch.equal(chosen, same & ~torch.eye(5, dtype=torch.bool))
    pairs = judged_pairs(chosen)
    assert pairs.tolist() == [[0, 1], [0, 2], [1, 2], [3, 4]]
    got = win_rates(chosen, pairs, torch.tensor([1.0, 0.5, 0.0, 0.25]))
    assert got.tolist() == [0.75, 0.0, 0.75, 0.25, 0.75]


def test_bounded_opponents_are_drawn_within_the_group_and_judged_once():
    """--pairwise_opponents k: each sample has exactly k opponents, all in its group, drawn from the generator (the
    same draw again for the same seed); a pair chosen from both sides is judged once; win rates average over the
    sample's own k opponents."""
    groups = torch.arange(2).repeat_interleave(6)
    chosen = opponents(groups, 2, torch.Generator().manual_seed(0))
    assert chosen.sum(1).tolist() == [2] * 12
    assert not (chosen & ~(groups[:, None] == groups[None, :])).any() and not chosen.diagonal().any()
    assert torch.equal(chosen, opponents(groups, 2, torch.Generator().manual_seed(0)))
    pairs = judged_pairs(chosen)
    assert len({tuple(p) for p in pairs.tolist()}) == len(pairs) == int((chosen | chosen.T).triu(1).sum())
    # the judge prefers the lower index: i's win rate is the share of its opponents above it
    rates = win_rates(chosen, pairs, torch.ones(len(pairs)))
    above = torch.stack([(chosen[i].nonzero()[:, 0] > i).double().mean() for i in range(12)])
    assert torch.equal(rates, above)
    assert torch.equal(opponents(groups, 5), opponents(groups))  # k >= group size - 1: all of them


def test_group_win_rates_calls_the_judge_on_each_pair_once_in_batches():
    """A stand-in judge that prefers the brighter image: in a group of 4 of brightness 0.1, 0.4, 0.2, 0.3 the win
    rates are 0, 1, 1/3, 2/3; 6 pairs in batches of 4 (two calls), the pair's prompt and metadata passed."""
    calls = []

    def brighter(prompts, a, b, metadata):
        calls.append((len(prompts), prompts, metadata))
        return (a.mean(dim=(1, 2, 3)) > b.mean(dim=(1, 2, 3))).double()

    images = torch.tensor([0.1, 0.4, 0.2, 0.3]).reshape(4, 1, 1, 1).expand(4, 3, 2, 2)
    prompts = ["p"] * 4
    got = group_win_rates(
        brighter, images, prompts, [{"k": i} for i in range(4)], torch.zeros(4, dtype=torch.long), 0, None, 4
    )
    assert torch.allclose(got, torch.tensor([0.0, 1.0, 1 / 3, 2 / 3], dtype=torch.float64))
    assert [c[0] for c in calls] == [4, 2] and calls[0][2][0] == {"k": 0}


def test_toy_pairwise_prefers_the_prompts_colour():
    """On rendered toy images: the right colour beats the wrong one (1 / 0 by order), two right or two wrong tie (0.5);
    a judge answer outside [0, 1] is one line."""
    g = torch.Generator().manual_seed(0)
    right = toy_world.render_prompts(["a red circle", "a blue square"], g)
    wrong = toy_world.render_prompts(["a green circle", "a cyan square"], g)
    judge = build_pairwise("toy_pairwise", "cpu")
    prompts = ["a red circle", "a blue square"]
    assert judge(prompts, right, wrong, [{}, {}]).tolist() == [1.0, 1.0]
    assert judge(prompts, wrong, right, [{}, {}]).tolist() == [0.0, 0.0]
    assert judge(prompts, right, right, [{}, {}]).tolist() == [0.5, 0.5]
    assert judge(prompts, wrong, wrong, [{}, {}]).tolist() == [0.5, 0.5]


def out_of_range_judge(prompts, images_a, images_b, metadata):
    return [2.0] * len(prompts)


def test_judges_by_name_or_dotted_path_and_bad_answers_are_one_line():
    assert parse_pairwise_spec("toy_pairwise") == ("toy_pairwise", None)
    assert parse_pairwise_spec("test_multi_reward:out_of_range_judge") == (
        "test_multi_reward:out_of_range_judge",
        None,
    )
    with pytest.raises(UserError, match="unknown judge 'nope'"):
        parse_pairwise_spec("nope")
    judge = build_pairwise("test_multi_reward:out_of_range_judge", "cpu")
    x = torch.zeros(1, 3, 2, 2)
    with pytest.raises(UserError, match=r"probabilities in \[0, 1\]"):
        judge(["p"], x, x, [{}])


# ---- config ----


@pytest.mark.parametrize(
    "argv, world, names",
    [
        (
            ["--reward_aggregation", "gdpo", "--global_std"],
            "1",
            ["--reward_aggregation gdpo", "--global_std"],
        ),
        (["--reward_aggregation", "gdpo", "--std_floor", "0.1"], "1", ["--std_floor 0.1"]),
        (["--pairwise_reward", "nope"], "1", ["unknown judge"]),
        (["--pairwise_opponents", "2"], "1", ["--pairwise_opponents", "--pairwise_reward"]),
        (
            ["--pairwise_reward", "toy_pairwise", "--reward_aggregation", "gdpo"],
            "1",
            ["gdpo", "--pairwise_reward"],
        ),
        (
            ["--pairwise_reward", "toy_pairwise", "--group_size", "4", "--sample_batch_size", "2"]
            + ["--sample_num_batches_per_epoch", "1"],
            "2",
            ["--pairwise_reward", "--group_size 4", "spans two"],
        ),
    ],
)
def test_bad_combinations_are_refused_in_one_line(argv, world, names, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(UserError) as e:
        parse_config(GRPOConfig, ["--pretrained_model", "x", *argv])
    assert "\n" not in str(e.value) and all(n in str(e.value) for n in names), str(e.value)


def test_nft_and_awm_take_the_aggregation():
    cfg = parse_config(
        NFTConfig, ["--pretrained_model", "x", "--reward_aggregation", "gdpo", "--group_size", "2"]
    )
    assert cfg.reward_aggregation == "gdpo"


# ---- GRPO on the toy world ----


def _toy_flags(out, preset: str, *extra: str) -> list[str]:
    return [
        *("--preset", preset, "--output_dir", str(out), "--device", "cpu", "--report_to", "none"),
        *("--num_epochs", "2", "--sample_batch_size", "4", "--sample_num_batches_per_epoch", "2"),
        *("--group_size", "4", "--train_batch_size", "4", "--train_gradient_accumulation_steps", "1"),
        *("--validation_prompts_file", "none", "--lora_init", "random"),
        *extra,
    ]


@pytest.mark.parametrize(
    "preset, extra, curves",
    [
        (
            "toy_world",
            ["--reward", "toy_color_match:1,toy_clean:0.5", "--reward_aggregation", "gdpo"],
            ["reward/total/mean", "reward/toy_color_match/mean", "reward/toy_clean/mean"],
        ),
        (  # toy-sd3 draws cyan right half the time: its groups' verdicts differ from the first epoch
            "toy_world_sd3",
            ["--reward", "toy_color_match", "--pairwise_reward", "toy_pairwise", "--pairwise_opponents", "2"],
            ["reward/pairwise/mean", "reward/toy_color_match/mean"],
        ),
    ],
)
def test_grpo_on_the_toy_world_with_gdpo_or_the_toy_judge_logs_each_curve(
    preset, extra, curves, tmp_path, capsys, monkeypatch
):
    """Two epochs of GRPO on the toy world: with two rewards under gdpo, and with the toy pairwise judge (2 opponents each):
    the epoch lines carry each curve, the LoRA moved and no base weight did."""
    from refl_ddpo.trainers import grpo

    watch = watch_training(monkeypatch)
    out = tmp_path / "grpo"
    grpo.main(_toy_flags(out, preset, *extra))
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2 and "epoch 2/2" in lines[1]
    for line in lines:
        assert all(c in line for c in curves), line
    watch.assert_lora_moved_and_base_not(out)


def test_a_rewards_per_sample_info_is_logged_beside_it():
    """info_stats: a single reward's per-sample info (HPSv3's sigma) as reward/<name>/<key>/mean, a weighted reward's
    parts' info under their own names, the parts themselves and non-per-sample entries left out, dropped samples too."""
    from types import SimpleNamespace

    from refl_ddpo.trainers.epochs import info_stats

    run = SimpleNamespace(accelerator=SimpleNamespace(gather=lambda x: x, device=torch.device("cpu")))
    batches = [
        SimpleNamespace(rewards=(torch.zeros(2), {"sigma": torch.tensor([1.0, 2.0]), "n": 3.0})),
        SimpleNamespace(rewards=(torch.zeros(2), {"sigma": torch.tensor([4.0, 100.0]), "n": 3.0})),
    ]
    finite = torch.tensor([True, True, True, False])
    assert info_stats("hpsv3", run, batches, finite) == {"reward/hpsv3/sigma/mean": 7 / 3}
    weighted = [
        SimpleNamespace(
            rewards=(torch.zeros(2), {"hpsv3": torch.ones(2), "hpsv3/sigma": torch.tensor([1.0, 3.0])})
        )
    ]
    assert info_stats("hpsv3:1,jpeg_compressibility:0.5", run, weighted, torch.tensor([True, True])) == {
        "reward/hpsv3/sigma/mean": 2.0
    }


def test_refl_logs_a_weighted_rewards_parts_and_info():
    """ReFL's step log: a weighted reward's total, each part's mean and std and a part's per-sample info (HPSv3's
    sigma), over the micro-batches, as the policy-gradient trainers log them."""
    from types import SimpleNamespace

    from refl_ddpo.trainers.backprop import MicroBatch
    from refl_ddpo.trainers.reward_backprop import log_step

    logged = {}
    accelerator = SimpleNamespace(
        gather=lambda x: x, device=torch.device("cpu"), log=lambda d, step: logged.update(d)
    )
    cfg = SimpleNamespace(
        gradient_accumulation_steps=2,
        reward="hpsv3:1,jpeg_compressibility:0.5",
        backprop_range=lambda: None,
        kl_weight=0.0,
        pretrain_loss_weight=0.0,
        image_log_steps=0,
    )
    terms = {"refl": 0.1, "kl": 0.0, "pretrain": 0.0}

    def micro(hps, jpeg, sigma):
        info = {
            "hpsv3": torch.tensor(hps),
            "jpeg_compressibility": torch.tensor(jpeg),
            "hpsv3/sigma": torch.tensor(sigma),
        }
        return MicroBatch(terms, info["hpsv3"] + 0.5 * info["jpeg_compressibility"], None, ["a"], info)

    results = [micro([2.0], [0.0], [1.0]), micro([4.0], [-2.0], [3.0])]
    bar = SimpleNamespace(set_postfix=lambda **kw: None, update=lambda n: None)
    log_step(SimpleNamespace(cfg=cfg, accelerator=accelerator), bar, 1, 3, 1e-4, 0.5, results, None)
    assert logged["reward/total/mean"] == 2.5 and logged["reward/hpsv3/mean"] == 3.0
    assert logged["reward/hpsv3/std"] == 1.0 and logged["reward/jpeg_compressibility/mean"] == -1.0
    assert logged["reward/hpsv3/sigma/mean"] == 2.0 and "reward/hpsv3/sigma/std" not in logged
