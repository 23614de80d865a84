"""Rewards of videos (B, T, 3, H, W): an image reward per frame reduced by mean, min, over K evenly spaced frames or
the first K, checked against the closed form on a reward of known value (each frame's brightness); the
temporal-consistency term against its formula; a weighted sum through `build_reward` on videos; first:K's K handed
to the decode; images pass through unchanged."""

import pytest
import torch

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.video import frame_indices, leading_frames, parse_reduction
from refl_ddpo.rewards import build_reward
from refl_ddpo.rewards.video import frames_reward, temporal_consistency


def brightness(images, prompts, metadata):
    """Each image's mean pixel, and the prompts' lengths as a per-image info tensor."""
    assert len(prompts) == len(metadata) == images.shape[0]
    return images.mean(dim=(1, 2, 3)), {"length": torch.tensor([float(len(p)) for p in prompts])}


def _videos() -> torch.Tensor:
    """Two videos of 5 frames, frame t of video b uniformly (b + 1) (t + 1) / 10 (frame 0 of video 0 the darkest)."""
    level = torch.tensor([[(b + 1) * (t + 1) / 10 for t in range(5)] for b in range(2)])
    return level[:, :, None, None, None].expand(2, 5, 3, 4, 4).clone()


@pytest.mark.parametrize(
    ("reduction", "expected"),
    [
        ("mean", [0.3, 0.6]),  # mean over t of (b + 1)(t + 1) / 10: (b + 1) * 0.3
        ("min", [0.1, 0.2]),  # frame 0
        ("mean:3", [0.3, 0.6]),  # frames 0, 2, 4: (1 + 3 + 5) / 3 / 10 (b + 1)
        ("min:2", [0.1, 0.2]),  # frames 0 and 4
        ("mean:1", [0.1, 0.2]),  # frame 0 alone
        ("first:2", [0.15, 0.3]),  # frames 0 and 1: (1 + 2) / 2 / 10 (b + 1)
        ("first:9", [0.3, 0.6]),  # more than the video has: all 5
    ],
)
def test_per_frame_reductions_match_the_closed_form(reduction, expected):
    rewards, info = frames_reward(brightness, reduction)(_videos(), ["ab", "abcd"], [{}, {"k": 1}])
    torch.testing.assert_close(rewards, torch.tensor(expected))
    torch.testing.assert_close(info["length"], torch.tensor([2.0, 4.0]))  # per-frame info reduced alike


def test_frame_indices_and_bad_reductions():
    assert frame_indices(81, 4) == [0, 27, 53, 80] and frame_indices(5, None) == [0, 1, 2, 3, 4]
    assert frame_indices(3, 8) == [0, 1, 2]
    assert parse_reduction("min:4") == ("min", 4) and frame_indices(81, 3, "first") == [0, 1, 2]
    assert leading_frames("first:9") == 9 and leading_frames("mean:9") is None
    for bad in ("median", "mean:0", "mean:x", "first", "first:0"):
        with pytest.raises(UserError, match="--video_reduction"):
            parse_reduction(bad)


def test_images_pass_through_unchanged():
    images = torch.rand(3, 3, 4, 4)
    torch.testing.assert_close(
        frames_reward(brightness, "min")(images, ["a"] * 3, [{}] * 3)[0], images.mean((1, 2, 3))
    )


def test_temporal_consistency_is_minus_the_mean_frame_to_frame_distance():
    videos = _videos().requires_grad_(True)
    fn = temporal_consistency(torch.device("cpu"), torch.float32, "")
    rewards, _ = fn(videos, ["a", "b"], [{}, {}])
    # consecutive frames of video b differ by (b + 1) / 10 at every pixel
    torch.testing.assert_close(rewards, torch.tensor([-(0.1**2), -(0.2**2)]))
    rewards.sum().backward()
    assert videos.grad is not None and videos.grad.abs().sum() > 0
    with pytest.raises(UserError, match="scores videos"):
        fn(torch.rand(2, 3, 4, 4), ["a", "b"], [{}, {}])


def test_first_k_reaches_the_reward_and_the_decode():
    """build_reward's Reward says first:K's K (`frames`) and the reward-backprop trainers' decode asks the family for
    those frames alone; other reductions, and images, decode whole."""
    from refl_ddpo.trainers.backprop import decode_scored

    class Family:
        def decode(self, latents, frames=None):
            return frames

    reward = build_reward(
        "jpeg_compressibility:1.0,temporal_consistency:2.0", "cpu", video_reduction="first:9"
    )
    assert (
        reward.frames == 9
        and build_reward("jpeg_compressibility", "cpu", video_reduction="mean:9").frames is None
    )
    assert decode_scored(Family(), torch.zeros(1, 4, 3, 2, 2), reward) == 9
    assert decode_scored(Family(), torch.zeros(1, 4, 2, 2), reward) is None  # images: the whole decode


def test_a_weighted_sum_on_videos_through_build_reward():
    """jpeg per frame (min over frames) plus the temporal term, each weighted: the sum of the parts' closed forms."""
    from refl_ddpo.rewards.jpeg import jpeg_size_kb

    videos = _videos()
    reward = build_reward("jpeg_compressibility:1.0,temporal_consistency:2.0", "cpu", video_reduction="min")
    assert not reward.differentiable
    total, info = reward(videos, ["a", "b"], [{}, {}])
    jpeg = (-jpeg_size_kb(videos.flatten(0, 1))).reshape(2, 5).min(1).values
    torch.testing.assert_close(total, jpeg + 2 * torch.tensor([-(0.1**2), -(0.2**2)]))
    torch.testing.assert_close(info["jpeg_compressibility"], jpeg)


def last_minus_first(videos, prompts, metadata):
    """A user's reward of whole videos: the last frame's mean pixel minus the first's."""
    return videos[:, -1].mean((1, 2, 3)) - videos[:, 0].mean((1, 2, 3)), {}


last_minus_first.video = True


def test_a_users_reward_of_whole_videos_gets_them_whole():
    """`pkg.module:function` with `function.video = True` is not wrapped in frames_reward (the reward server serves
    it so, e.g. a VideoAlign-style scorer); a user's image reward is."""
    reward = build_reward("test_video_rewards:last_minus_first", "cpu")
    assert reward.video and not build_reward("test_video_rewards:brightness", "cpu").video
    assert torch.allclose(reward(_videos(), ["a", "b"], [{}, {}])[0], torch.tensor([0.4, 0.8]))
