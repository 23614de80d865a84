"""Rewards judged by a vision-language model behind an OpenAI-compatible chat server (vLLM, sglang, ...). Not
differentiable.

    vlm_judge       asks "Does this image show {prompt}? Answer yes or no." (--vlm_question) about each image;
                    the reward is P(yes) / (P(yes) + P(no)) from the answer token's top log-probs when the server
                    returns them, else 1 for an answer starting with yes and 0 for no (anything else is an error).
    vlm_bertscore   ddpo-pytorch's prompt-image alignment (Black et al. 2023, its LLaVA + BERTScore server): the VLM
                    describes the image ("Describe this image in one sentence."), and the reward is the BERTScore
                    recall of the prompt against that description, computed here with a transformers encoder:
                    each prompt token's greatest cosine similarity to a description token, averaged over the prompt's
                    tokens (contextual embeddings of one hidden layer, special tokens left out, no idf weighting,
                    no baseline rescaling; Zhang et al. 2020).

Server: `vlm_judge:URL` / `vlm_bertscore:URL`, else $OPENAI_BASE_URL, asked through the one client of the VLM rewards
(refl_ddpo.rewards.vlm_client: the model, concurrency, timeouts, retries, one-line errors). The other VLM rewards
(unifiedreward, vlm_yesno, geneval2, vlm_pairwise) are in refl_ddpo.rewards.vlm_scores.

BERTScore model: `<reward_model_dir>/bertscore/` (an AutoModel folder with its tokenizer), else the hub id
roberta-large (bert_score's default for English), read at hidden layer min(17, layers) (17 is bert_score's layer for
roberta-large).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from refl_ddpo.core.errors import UserError
from refl_ddpo.rewards.vlm_client import (
    VLM,
    answer_text,
    fill_prompt,
    judged_reward,
    one_line,
    yes_probability,
)

JUDGE_QUESTION = "Does this image show {prompt}? Answer yes or no."
DESCRIBE_QUESTION = "Describe this image in one sentence."
BERTSCORE_DIR = "bertscore"
BERTSCORE_HUB_ID = "roberta-large"
BERTSCORE_LAYER = 17


def vlm_judge(
    device: torch.device,
    dtype: torch.dtype,
    model_dir: str,
    url: str | None = None,
    model: str | None = None,
    question: str | None = None,
    **client_options,
):
    vlm = VLM(url, model, **client_options)
    template = question or JUDGE_QUESTION

    def judge(images: torch.Tensor, prompts: list[str]) -> list[float]:
        choices = vlm.ask(images, [fill_prompt(template, p) for p in prompts], max_tokens=1, logprobs=True)
        return [yes_probability(c, vlm.base_url) for c in choices]

    return judged_reward(device, judge)


# ---- BERTScore recall ----


class BERTScorer:
    """BERTScore recall of references against candidates with a transformers encoder (see the module docstring)."""

    def __init__(self, model_dir: str | os.PathLike, device, layer: int | None = None):
        import transformers
        from transformers import AutoModel, AutoTokenizer

        local = Path(model_dir) / BERTSCORE_DIR
        source = str(local) if (local / "config.json").is_file() else BERTSCORE_HUB_ID
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(source)
            self.model = AutoModel.from_pretrained(source).to(device).eval()
        except (OSError, ValueError) as e:
            raise UserError(
                f"vlm_bertscore: BERTScore model not found at {local} and {BERTSCORE_HUB_ID} could not be loaded "
                f"({one_line(e)}); put an AutoModel folder with its tokenizer there (save_pretrained)."
            ) from None
        finally:
            transformers.logging.set_verbosity(verbosity)
        self.model.requires_grad_(False)
        self.layer = layer if layer is not None else min(BERTSCORE_LAYER, self.model.config.num_hidden_layers)
        self.device = device

    @torch.no_grad()
    def embed(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L, D) L2-normalised token embeddings of hidden layer `layer`, and the (B, L) mask of real tokens
        (padding and the special tokens, e.g. [CLS] [SEP], are left out)."""
        tokens = self.tokenizer(
            list(texts), padding=True, truncation=True, return_tensors="pt", return_special_tokens_mask=True
        )
        special = tokens.pop("special_tokens_mask").bool()
        tokens = tokens.to(self.device)
        hidden = self.model(**tokens, output_hidden_states=True).hidden_states[self.layer]
        mask = tokens["attention_mask"].bool() & ~special.to(self.device)
        return torch.nn.functional.normalize(hidden.float(), dim=-1), mask

    def recall(self, candidates: list[str], references: list[str]) -> torch.Tensor:
        """(B,) mean over each reference's tokens of the greatest cosine to a token of its candidate."""
        cand, cand_mask = self.embed(candidates)
        ref, ref_mask = self.embed(references)
        sim = ref @ cand.transpose(1, 2)  # (B, L_ref, L_cand)
        sim = sim.masked_fill(~cand_mask[:, None, :], -2.0)
        best = sim.max(dim=2).values  # (B, L_ref)
        count = ref_mask.sum(1)
        recall = (best * ref_mask).sum(1) / count.clamp(min=1)
        empty = (count == 0) | (cand_mask.sum(1) == 0)  # nothing to compare: no alignment
        return torch.where(empty, torch.zeros_like(recall), recall).cpu()


def vlm_bertscore(
    device: torch.device,
    dtype: torch.dtype,
    model_dir: str,
    url: str | None = None,
    model: str | None = None,
    question: str | None = None,
    max_tokens: int = 64,
    **client_options,
):
    scorer = BERTScorer(model_dir, device)  # local first: a missing model fails before the server is asked
    vlm = VLM(url, model, **client_options)
    template = question or DESCRIBE_QUESTION

    def reward_fn(images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        choices = vlm.ask(images, [fill_prompt(template, p) for p in prompts], max_tokens, logprobs=False)
        descriptions = [answer_text(c) for c in choices]
        rewards = scorer.recall(descriptions, list(prompts))
        return rewards.to(device=device, dtype=torch.float32), {}

    return reward_fn
