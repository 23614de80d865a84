"""refl_ddpo: fine-tune Stable Diffusion on a reward with ReFL or DDPO, LoRA on one shared core."""

from refl_ddpo.ddim import ddim_step_with_logprob

__all__ = ["ddim_step_with_logprob"]
__version__ = "0.1.0"
