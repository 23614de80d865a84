"""Rewards read from a VLM's answers, on the one client (refl_ddpo.rewards.vlm_client). Not differentiable.

    unifiedreward   pointwise: the VLM judges the image against its caption and ends with "Final Score: X"
                    (UnifiedReward's form; "Final Score (1-5): X" and markdown bold are read too); the reward is the
                    last such X / score_max (5), as flow_grpo scales it. An answer without one is a one-line error.
    vlm_yesno       VQAScore (Lin et al. 2024): the probability the VLM gives "Yes" as its first answer token to
                    'Does this image show "{prompt}"? Answer with Yes or No.', summed over the top log-probs' forms of
                    yes ('Yes', ' yes', ...); not normalised against "No" (vlm_judge is). It needs log-probs.
    geneval2        Soft-TIFA (GenEval 2, Kamath et al. 2025): each question of the prompt's metadata (`vqa_list`:
                    [question, answer] pairs, as GenEval 2's data gives them; else questions made from GenEval's
                    `include` / `exclude` lists) is asked as "{question} Answer in one word.", scored by the
                    probability of the expected answer as the first token (its number word and numeral both count);
                    the reward is their arithmetic mean (Soft-TIFA AM; `aggregate="gm"`: the geometric mean, GM).
                    Both are logged. A form of GenEval for users without mmdet.
    vlm_pairwise    which of two images better fits the prompt (a pairwise judge, not a reward): P(image a better),
                    from the log-probs of the answer "1" against "2", else 1 / 0 from the text ("1", "Image 1 is
                    better"); asked in both orders and averaged (position bias cancels) unless both_orders=False.

Top log-probs: the servers give at most about 20 per token; an answer outside them counts 0.
"""

from __future__ import annotations

import math
import re

import torch

from refl_ddpo.core.errors import UserError
from refl_ddpo.rewards.vlm_client import (
    VLM,
    answer_text,
    fill_prompt,
    judged_reward,
    one_line,
    token_probability,
    top_logprobs,
)

UNIFIEDREWARD_QUESTION = (
    "You are given a text caption and an image generated from it. Judge the image on how well it matches the "
    "caption (the objects, their attributes and relations) and on its visual quality (clarity, detail, colour, "
    "aesthetics). Reason briefly, then end with 'Final Score: X' where X is a score from 1 to 5.\n"
    "Text Caption: [{prompt}]"
)
YESNO_QUESTION = 'Does this image show "{prompt}"? Answer with Yes or No.'
PAIRWISE_QUESTION = (
    "You are given a text caption and two images generated from it, Image 1 and Image 2. Which image matches the "
    "caption better, in content and in quality? Answer with 1 or 2.\nText Caption: [{prompt}]"
)
TOP_LOGPROBS = 20
FINAL_SCORE = re.compile(
    r"final\s+score\s*(?:\(\s*\d+\s*-\s*\d+\s*\))?\s*\**\s*[:：]?\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE
)
PAIR_CHOICE = re.compile(r"image\s*([12])\s*is\s*(?:the\s*)?better", re.IGNORECASE)
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
IRREGULAR_PLURALS = {"person": "people", "sheep": "sheep", "knife": "knives", "mouse": "mice", "skis": "skis"}


def final_score(text: str, score_max: float, base_url: str) -> float:
    """The last 'Final Score: X' of an answer, / score_max; a one-line error when there is none or X is out of
    [0, score_max]."""
    found = FINAL_SCORE.findall(text)
    value = float(found[-1]) if found else None
    if value is None or not 0 <= value <= score_max:
        raise UserError(
            f"vlm server {base_url}: the judge answered {one_line(text)[-80:]!r}, with no 'Final Score: X' in "
            f"[0, {score_max:g}]; ask a question it ends that way (--vlm_question) or raise max_tokens."
        )
    return value / score_max


def _needs_logprobs(choice: dict, base_url: str, reward: str) -> list[dict]:
    top = top_logprobs(choice)
    if top is None:
        raise UserError(
            f"vlm server {base_url}: {reward} needs the answer's top log-probs and the server sent none; serve the "
            "model with log-probs enabled (vLLM and sglang send them when asked)."
        )
    return top


def unifiedreward(
    device: torch.device,
    dtype: torch.dtype,
    model_dir: str,
    url: str | None = None,
    model: str | None = None,
    question: str | None = None,
    max_tokens: int = 512,
    score_max: float = 5.0,
    **client_options,
):
    vlm = VLM(url, model, **client_options)
    template = question or UNIFIEDREWARD_QUESTION

    def judge(images: torch.Tensor, prompts: list[str]) -> list[float]:
        choices = vlm.ask_each(images, template, prompts, max_tokens)
        return [final_score(answer_text(c), score_max, vlm.base_url) for c in choices]

    return judged_reward(device, judge)


def vlm_yesno(
    device: torch.device,
    dtype: torch.dtype,
    model_dir: str,
    url: str | None = None,
    model: str | None = None,
    question: str | None = None,
    **client_options,
):
    vlm = VLM(url, model, **client_options)
    template = question or YESNO_QUESTION

    def judge(images: torch.Tensor, prompts: list[str]) -> list[float]:
        choices = vlm.ask_each(images, template, prompts, max_tokens=1, logprobs=TOP_LOGPROBS)
        tops = [_needs_logprobs(c, vlm.base_url, "vlm_yesno") for c in choices]
        return [token_probability(top, {"yes"}) for top in tops]

    return judged_reward(device, judge)


# ---- geneval2: Soft-TIFA ----


def plural(name: str) -> str:
    """English plural of a GenEval class name ('wine glass' -> 'wine glasses', 'person' -> 'people')."""
    head, _, last = name.rpartition(" ")
    if last in IRREGULAR_PLURALS:
        word = IRREGULAR_PLURALS[last]
    elif last.endswith(("s", "x", "ch", "sh")):
        word = last + "es"
    elif last.endswith("y") and last[-2:-1] not in "aeiou":
        word = last[:-1] + "ies"
    else:
        word = last + "s"
    return f"{head} {word}" if head else word


def _position(relation: str) -> str:
    return {"left of": "to the left of", "right of": "to the right of"}.get(relation, relation)


def geneval_questions(metadata: dict) -> list[tuple[str, str]]:
    """Soft-TIFA's [question, answer] pairs of a GenEval prompt's include / exclude lists: per included object, is
    there any, how many, its colour, its position relative to the object it names; per excluded class not included,
    is there any (answer no)."""
    include = metadata.get("include") or []
    pairs = []
    for req in include:
        name, count = str(req["class"]), int(req["count"])
        many = plural(name)
        pairs += [
            (f"Are there any {many} in the image?", "yes"),
            (f"How many {many} are in the image?", _word(count)),
        ]
        if "color" in req:
            subject = f"Is the {name}" if count == 1 else f"Are the {many}"
            pairs.append((f"{subject} {req['color']}?", "yes"))
        if "position" in req:
            relation, target = req["position"]
            subject = f"Is the {name}" if count == 1 else f"Are the {many}"
            pairs.append((f"{subject} {_position(relation)} the {include[int(target)]['class']}?", "yes"))
    included = {str(req["class"]) for req in include}
    for req in metadata.get("exclude") or []:
        if str(req["class"]) not in included:
            pairs.append((f"Are there any {plural(str(req['class']))} in the image?", "no"))
    return pairs


def _word(count: int) -> str:
    return NUMBER_WORDS[count] if 0 <= count < len(NUMBER_WORDS) else str(count)


def answer_forms(answer: str) -> set[str]:
    """The first-token forms of an expected answer: itself in lower case, and a number's word and numeral."""
    word = answer.strip().lower()
    forms = {word}
    if word in NUMBER_WORDS:
        forms.add(str(NUMBER_WORDS.index(word)))
    elif word.isdigit() and int(word) < len(NUMBER_WORDS):
        forms.add(NUMBER_WORDS[int(word)])
    return forms


def soft_tifa_pairs(prompt: str, metadata: dict) -> list[tuple[str, str]]:
    """The prompt's [question, answer] pairs: its `vqa_list`, else those of its GenEval lists; else a one-line error."""
    pairs = metadata.get("vqa_list")
    if pairs is None and metadata.get("include"):
        pairs = geneval_questions(metadata)
    if not pairs or not all(isinstance(p, list | tuple) and len(p) == 2 for p in pairs):
        raise UserError(
            f"geneval2: the prompt {prompt[:60]!r} has no vqa_list of [question, answer] pairs and no GenEval include "
            "list in its metadata; give the prompts with --prompt_fn geneval_file --prompts_file F (GenEval 2's or "
            "flow_grpo's GenEval JSONL)."
        )
    return [(str(q), str(a)) for q, a in pairs]


def geneval2(
    device: torch.device,
    dtype: torch.dtype,
    model_dir: str,
    url: str | None = None,
    model: str | None = None,
    aggregate: str = "am",
    **client_options,
):
    if aggregate not in ("am", "gm"):
        raise UserError(f"geneval2: aggregate must be am or gm (got {aggregate!r}).")
    vlm = VLM(url, model, **client_options)

    def reward_fn(images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        asked = [(i, q, a) for i, p in enumerate(prompts) for q, a in soft_tifa_pairs(p, metadata[i])]
        messages = [[images[i], f"{q} Answer in one word."] for i, q, _ in asked]
        choices = vlm.chat(messages, max_tokens=1, logprobs=TOP_LOGPROBS)
        scores: list[list[float]] = [[] for _ in prompts]
        for (i, _, a), choice in zip(asked, choices, strict=True):
            top = _needs_logprobs(choice, vlm.base_url, "geneval2")
            scores[i].append(min(token_probability(top, answer_forms(a)), 1.0))
        am = torch.tensor([sum(s) / len(s) for s in scores], dtype=torch.float32, device=device)
        gm = [math.exp(sum(map(math.log, s)) / len(s)) if min(s) > 0 else 0.0 for s in scores]
        gm = torch.tensor(gm, dtype=torch.float32, device=device)
        info = {"soft_tifa_am": am, "soft_tifa_gm": gm}
        return (am if aggregate == "am" else gm), info

    return reward_fn


# ---- vlm_pairwise: which of two images ----


def pair_choice(choice: dict, base_url: str) -> float:
    """P(Image 1 better) of one answer: p("1") / (p("1") + p("2")) over the first token's top log-probs when they
    hold either, else 1 / 0 from the text ('1', '2', 'Image 1 is better'); else a one-line error."""
    top = top_logprobs(choice)
    if top is not None:
        p1, p2 = token_probability(top, {"1"}), token_probability(top, {"2"})
        if p1 + p2 > 0:
            return p1 / (p1 + p2)
    text = answer_text(choice)
    found = PAIR_CHOICE.findall(text)
    bare = text.strip(" .*")
    digit = found[-1] if found else bare if bare in ("1", "2") else None
    if digit is None:
        raise UserError(
            f"vlm server {base_url}: the pairwise judge answered {one_line(text)[-80:]!r}, neither 1 nor 2 nor "
            "'Image N is better'; ask a question it answers that way."
        )
    return 1.0 if digit == "1" else 0.0


def pairwise_probabilities(
    vlm: VLM,
    prompts: list[str],
    images_a: list[torch.Tensor],
    images_b: list[torch.Tensor],
    question: str = PAIRWISE_QUESTION,
    both_orders: bool = True,
    max_tokens: int = 16,
) -> list[float]:
    """P(a better than b) per (prompt, image a [3, H, W], image b): all requests at once on the client."""

    def message(prompt, first, second):
        return ["Image 1:", first, "Image 2:", second, fill_prompt(question, prompt)]

    messages = [message(p, a, b) for p, a, b in zip(prompts, images_a, images_b, strict=True)]
    if both_orders:
        messages += [message(p, b, a) for p, a, b in zip(prompts, images_a, images_b, strict=True)]
    probs = [pair_choice(c, vlm.base_url) for c in vlm.chat(messages, max_tokens, TOP_LOGPROBS)]
    n = len(prompts)
    return [(probs[i] + 1 - probs[n + i]) / 2 for i in range(n)] if both_orders else probs


def vlm_pairwise(
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    model_dir: str | None = None,
    url: str | None = None,
    model: str | None = None,
    question: str | None = None,
    both_orders: bool = True,
    **client_options,
):
    """The pairwise judge of --pairwise_reward vlm_pairwise[:URL] (refl_ddpo.rewards.pairwise's contract):
    `judge(prompts, images_a, images_b, metadata) -> [P(image a fits its prompt better)]`, floats in [0, 1], the P
    pairs' requests sent at once (the client bounds the requests in flight)."""
    vlm = VLM(url, model, **client_options)
    template = question or PAIRWISE_QUESTION

    def judge(prompts, images_a: torch.Tensor, images_b: torch.Tensor, metadata=None) -> list[float]:
        return pairwise_probabilities(
            vlm, list(prompts), list(images_a), list(images_b), template, both_orders
        )

    return judge
