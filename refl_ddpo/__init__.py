"""refl_ddpo: fine-tune Stable Diffusion on a reward with ReFL or DDPO, LoRA on one shared core."""

__all__ = ["ddim_step_with_logprob", "flow_sde_step_with_logprob"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so that `python -m refl_ddpo.<script> --bad-flag` fails fast without importing diffusers.
    if name == "ddim_step_with_logprob":
        from refl_ddpo.core.steps.ddim import ddim_step_with_logprob

        return ddim_step_with_logprob
    if name == "flow_sde_step_with_logprob":
        from refl_ddpo.core.steps.flow_sde import flow_sde_step_with_logprob

        return flow_sde_step_with_logprob
    raise AttributeError(f"module 'refl_ddpo' has no attribute {name!r}")
