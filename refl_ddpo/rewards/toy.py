"""Rewards of the toy world (refl_ddpo.toy_world.world): coloured shapes on grey, prompts `a {colour} {shape}`.

    toy_color_match   1.0 where the judge finds the shape's mean colour nearest to the prompt's colour, else 0.0;
                      programmatic, not differentiable; info carries the judge's `dirty` fraction per image
    toy_classifier    p(prompt's colour) * p(prompt's shape) from the toy classifier's two softmaxes, read at
                      temperature 8 (at 1 they are saturated at 0 / 1 and give reward backprop no gradient);
                      differentiable. Reads <model_dir>/toy_classifier.{safetensors,json}, written by
                      `python -m refl_ddpo.tiny OUT --toy_world`. Images of another size are resized to 32 x 32
                      (bilinear, antialiased: differentiable).
    toy_clean         the judge's cleanliness, softened to be differentiable: the mean over pixels of
                      sigmoid((CLEAN_THRESHOLD - d) / CLEAN_SOFTNESS), d the distance (0..255, RGB L2) to the nearest
                      allowed colour: background grey or the prompt's colour inside the frame, grey only on its
                      1-pixel border ring. 1 for a rendered image; blotches of other colours, a tinted background
                      and a colour on the border lower it; a blank grey image scores 1 too, so it is a term to add,
                      not a reward on its own. DESIGN's "background term" against the reward hacking of a colour
                      reward: `--reward toy_classifier:1,toy_clean:0.2` (measured: docs/record/toy_world.md).
    toy_palette_clean toy_clean with every palette colour allowed inside the frame, not only the prompt's: it does
                      not say which colour is right, so a shape of the wrong colour is as clean as one of the right
                      colour and only its anti-aliased edge costs. Beside a 0/1 colour reward (GRPO) toy_clean pays
                      a group whose shapes all have the wrong colour for shrinking them; this one does not. Tried as
                      GRPO's toy recipe, it kept the shapes but learned the colour slower and less steadily
                      (docs/record/learning_spread.md).
    toy_color_clean   toy_color_match * (1 + toy_clean): the two summed where the colour is right, 0 where it is
                      wrong, so cleanliness counts only on a shape of the right colour. Beside the 0/1 colour reward,
                      plain toy_clean pays a wrong-coloured shape for shrinking (its pixels are dirty), and GRPO's
                      group std scales that up to +-1 in a group whose colours are all wrong; here such a group has
                      equal rewards and no gradient. Not differentiable.
    toy_judge         the judge's verdict per image: 1.0 where the colour is the prompt's (toy_color_match) and
                      the shape is clean by the judge's measures, grey >= JUDGE_MIN_GREY (0.4: the largest
                      rendered shape, a 24-pixel square, leaves 0.4375 of the frame grey), dirty <= JUDGE_MAX_DIRTY
                      (0.2: a rendered image has 0; the learning proofs bound the rise of the mean by 0.2) and
                      ragged <= JUDGE_MAX_RAGGED (0.7: the most ragged rendered shape, the 10-pixel triangle, has
                      0.64); else 0.0. info carries the four measures per image (colour_ok, grey, dirty, ragged).
                      A gold measure for validation, apart from the proxy a trainer optimises: a frame filled with
                      the colour, blotches and shapes broken into specks all score 0. On the committed base models,
                      6 held-out prompts x 16 seeds at 20 steps: toy-sd 0.33 (colour accuracy 0.42), toy-sd3 0.44
                      (accuracy 0.50). Not differentiable.

All parse prompts with `toy_world.parse_prompt`: a prompt outside the grammar is a one-line UserError.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from refl_ddpo.toy_world import world as toy_world


def toy_color_match(device: torch.device, dtype: torch.dtype, model_dir: str, **options):
    def reward_fn(images, prompts, metadata):
        res = toy_world.judge(images, list(prompts))
        rewards = res["colour_ok"].to(device=device, dtype=torch.float32)
        return rewards, {"dirty": res["dirty"].to(device)}

    return reward_fn


# toy_judge's bounds on the judge's measures, per image (see the module doc for where each comes from)
JUDGE_MIN_GREY = 0.4
JUDGE_MAX_DIRTY = 0.2
JUDGE_MAX_RAGGED = 0.7


def judge_verdict(result: dict) -> torch.Tensor:
    """The verdict (B,) bool of a `toy_world.judge` result: the right colour and a clean shape."""
    return (
        result["colour_ok"]
        & (result["grey"] >= JUDGE_MIN_GREY)
        & (result["dirty"] <= JUDGE_MAX_DIRTY)
        & (result["ragged"] <= JUDGE_MAX_RAGGED)
    )


def toy_judge(device: torch.device, dtype: torch.dtype, model_dir: str, **options):
    def reward_fn(images, prompts, metadata):
        res = toy_world.judge(images, list(prompts))
        info = {
            k: res[k].to(device=device, dtype=torch.float32) for k in ("colour_ok", "grey", "dirty", "ragged")
        }
        return judge_verdict(res).to(device=device, dtype=torch.float32), info

    return reward_fn


# The classifier is (over)confident: at temperature 1 its softmax is 0 or 1 on nearly every image the model draws,
# which leaves reward backprop no gradient. Its probabilities are read at this temperature instead.
TEMPERATURE = 8.0


def toy_classifier(
    device: torch.device, dtype: torch.dtype, model_dir: str, temperature: float = TEMPERATURE, **options
):
    model = toy_world.load_classifier(model_dir, device=device, dtype=dtype)

    def reward_fn(images, prompts, metadata):
        colour_idx, shape_idx = (t.to(device) for t in toy_world.prompt_indices(list(prompts)))
        x = images.to(device=device, dtype=dtype)
        if x.shape[-2:] != (toy_world.SIZE, toy_world.SIZE):
            x = F.interpolate(
                x,
                size=(toy_world.SIZE, toy_world.SIZE),
                mode="bilinear",
                align_corners=False,
                antialias=x.shape[-1] > toy_world.SIZE,
            )
        logits_c, logits_s = model(x)
        p_colour = (logits_c.float() / temperature).softmax(-1).gather(1, colour_idx[:, None])[:, 0]
        p_shape = (logits_s.float() / temperature).softmax(-1).gather(1, shape_idx[:, None])[:, 0]
        return (p_colour * p_shape).float(), {"p_colour": p_colour.detach(), "p_shape": p_shape.detach()}

    return reward_fn


# d = CLEAN_THRESHOLD scores 0.5; d 20 levels nearer scores 0.88, 20 farther 0.12.
CLEAN_SOFTNESS = 10.0


def toy_clean(
    device: torch.device, dtype: torch.dtype, model_dir: str, softness: float = CLEAN_SOFTNESS, **options
):
    return _clean(device, softness, any_palette_colour=False)


def toy_palette_clean(
    device: torch.device, dtype: torch.dtype, model_dir: str, softness: float = CLEAN_SOFTNESS, **options
):
    return _clean(device, softness, any_palette_colour=True)


def toy_color_clean(
    device: torch.device, dtype: torch.dtype, model_dir: str, softness: float = CLEAN_SOFTNESS, **options
):
    colour, clean = (
        toy_color_match(device, dtype, model_dir),
        _clean(device, softness, any_palette_colour=False),
    )

    def reward_fn(images, prompts, metadata):
        ok, info = colour(images, prompts, metadata)
        return ok * (1 + clean(images, prompts, metadata)[0]), info

    return reward_fn


def _clean(device: torch.device, softness: float, any_palette_colour: bool):
    grey = torch.tensor(toy_world.BACKGROUND, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    palette = torch.tensor(list(toy_world.COLOURS.values()), dtype=torch.float32, device=device)

    def distance_to(x: torch.Tensor, colour: torch.Tensor) -> torch.Tensor:  # RGB L2 over dim 1, smooth at 0
        return (x - colour).square().sum(1).add(1e-6).sqrt()

    def reward_fn(images, prompts, metadata):
        # also the one-line error for a prompt outside the grammar
        colour_idx, _ = toy_world.prompt_indices(list(prompts))
        x = images.to(device=device, dtype=torch.float32) * 255
        d_grey = distance_to(x, grey)
        if any_palette_colour:
            d_colour = torch.stack([distance_to(x, c.view(1, 3, 1, 1)) for c in palette]).amin(0)
        else:
            d_colour = distance_to(x, palette[colour_idx.to(device)].view(-1, 3, 1, 1))
        ring = torch.ones(x.shape[-2:], dtype=torch.bool, device=device)
        ring[1:-1, 1:-1] = False
        d = torch.where(ring, d_grey, torch.minimum(d_grey, d_colour))
        clean = torch.sigmoid((toy_world.CLEAN_THRESHOLD - d) / softness).mean(dim=(1, 2))
        return clean, {}

    return reward_fn
