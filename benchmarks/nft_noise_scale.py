"""The gradient noise scale N* of DiffusionNFT's first update (docs/record/trainers.md, "All 12 training prompts").

Runs the trainer's own first epoch (sampling, rewards, group advantages), then takes one gradient of the NFT loss per
sample over the LoRA (one random trained timestep, fresh noise, the weights equal to the old policy's) and prints
N* = tr(Sigma) / |G|^2: Sigma the per-sample gradients' covariance, G their mean; N*_debiased uses |G|^2 - tr(Sigma) / n
(negative when n samples cannot tell the mean from noise). N* is the batch at which a step's signal equals its noise.

    python benchmarks/nft_noise_scale.py --preset toy_world --sample_num_batches_per_epoch 16 --seed 0 \
        --device cpu --report_to none --validation_prompts_file none --output_dir OUT [--prompt_fn toy_world_train
        --group_size 4]
"""

import sys

import torch

from refl_ddpo.core.families import cond_cat
from refl_ddpo.run.training import seeded_generator
from refl_ddpo.trainers.forward_config import NFTConfig
from refl_ddpo.trainers.nft import NFT
from refl_ddpo.trainers.skeleton import main_for


class NoiseScale(NFT):
    """NFT whose first epoch measures N* instead of training, then stops."""

    def train(self, run, epoch, plan, scored):
        cfg, family = self.cfg, run.family
        x0 = torch.cat([b.latents for b in scored.batches])
        cond = cond_cat([b.cond for b in scored.batches])
        adv = scored.advantages.to(x0.device)
        schedule = family.set_timesteps(self.scheduler, cfg.sample_num_steps, x0)
        gen = seeded_generator(cfg.seed, epoch, 0, 9)
        run.network.train()
        grads = []
        for i in range(len(x0)):
            batch = {"x0": x0[i : i + 1], "advantages": adv[i : i + 1]}
            c = {k: v[i : i + 1] for k, v in cond.items()}
            draw = self.draws(family, schedule, batch["x0"], 1, gen)[0]
            loss, _ = self.draw_loss(run, batch, c, draw, None)
            g = torch.autograd.grad(loss, run.params)
            grads.append(torch.cat([t.flatten() for t in g]).double())
        G = torch.stack(grads)  # (n, P)
        n = len(G)
        mean = G.mean(0)
        tr = G.var(0, unbiased=True).sum()
        g2 = mean.square().sum()
        print(
            f"samples {n}, LoRA parameters {G.shape[1]}: tr(Sigma) {float(tr):.4g}, |G|^2 {float(g2):.4g}, "
            f"N* {float(tr / g2):.0f}, N*_debiased {float(tr / (g2 - tr / n)):.0f}",
            flush=True,
        )
        raise SystemExit(0)


if __name__ == "__main__":
    main_for(NoiseScale, NFTConfig, sys.argv[1:], __doc__)
