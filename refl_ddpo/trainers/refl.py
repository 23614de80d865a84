"""Reward backprop: ReFL (Xu et al. 2023, "ImageReward", Algorithm 1), DRaFT-K / DRaFT-LV (Clark et al. 2023) and
AlignProp (Prabhudesai et al. 2023) on the shared core, LoRA or full network.

    python -m refl_ddpo.trainers.refl [--flag value ...]      (usually via train_scripts/train_refl_lora.sh)

One optimizer step, as ImageReward's ReFL.py (and its LoRA hackathon version), with every constant a flag:

    k ~ U{k_lo..k_hi}                      one draw per optimizer step, from a generator seeded alike on every process
    x_T ~ N(0, I)                          (B, C, resolution / vae_scale_factor, ...), per-process generator
    x_T -> ... -> x_{t_k}                  steps 0..k-1 of the T-step sampler (DDPM as the reference, or DDIM), no grad
    x0 = scheduler.step(net(x_{t_k}))      step k with gradient; the scheduler's predicted x0
    image = VAE.decode(x0) / 2 + 0.5       gradient flows through the decoder; clamp to [0, 1]
    r = reward(image)                      e.g. ImageReward: bicubic resize 224, centre crop, CLIP mean/std, as tensor ops
    loss = relu(margin - r).mean() * grad_scale                  (margin 2, grad_scale 1e-3 / 0.01 in the LoRA recipe)
         + pretrain_loss_weight * MSE(net(noisy x, t), noise)    optional, on an image-caption folder
         + kl_weight * KL term vs the base model                 optional, LoRA only, at the grad step(s) (`kl_to_base`)

State (`output_dir/checkpoint-N`): the LoRA (or network), optimizer and accelerate state through accelerate's
`save_state`; the step, the lr-scheduler state and the EMA scalars as JSON; the generators (the shared k generator
and every process's own) and the EMA weights as safetensors. A resumed run continues bit-exactly on CPU.
"""

from refl_ddpo.core.errors import cli_main
from refl_ddpo.run.session import main_for
from refl_ddpo.trainers.refl_config import ReFLConfig
from refl_ddpo.trainers.reward_backprop import build_refl_reward, preflight, train

__all__ = ["ReFLConfig", "build_refl_reward", "main", "preflight", "train"]


@cli_main
def main(argv: list[str] | None = None) -> None:
    main_for(train, preflight, ReFLConfig, argv, __doc__)


if __name__ == "__main__":
    main()
