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
from functools import partial

import torch

from refl_ddpo.core.families import cond_cat
from refl_ddpo.run.runs import start_run
from refl_ddpo.run.session import add_optimizer, begin_run, load_run, main_for, open_accelerator, prepare
from refl_ddpo.run.training import seeded_generator
from refl_ddpo.trainers.ddpo_config import num_train_timesteps
from refl_ddpo.trainers.epochs import EpochPlan, report_epoch, score_epoch
from refl_ddpo.trainers.forward_config import NFTConfig
from refl_ddpo.trainers.forward_process import (
    forward_advantages,
    forward_checks,
    forward_sizes,
    keep_copies,
    new_state,
    preflight,
    sampling_weights,
)
from refl_ddpo.trainers.forward_training import NFT, draw_timesteps
from refl_ddpo.trainers.groups import grouped_prompts
from refl_ddpo.trainers.rollouts import collect_rewards, sample_clean


def noise_scale(cfg: NFTConfig) -> None:
    """DiffusionNFT's set-up and first epoch as refl_ddpo.trainers.forward_process.train runs them (sampling,
    rewards, group advantages), then N* of the first update instead of training."""
    cfg = forward_checks(cfg)
    info = start_run(cfg, NFT.name, "num_epochs")
    accelerator = open_accelerator(cfg, cfg.train_gradient_accumulation_steps * num_train_timesteps(cfg))
    run = load_run(cfg, info, accelerator, NFT.name, "epoch")
    cfg, fp = run.cfg, new_state(run, NFT)
    add_optimizer(run)
    keep_copies(run, fp)
    prepare(run)
    begin_run(run, forward_sizes(cfg, accelerator.num_processes))
    plan = EpochPlan(*grouped_prompts(cfg, run.family, 0, run.rank, accelerator.num_processes, run.dtype))
    with sampling_weights(run, fp):
        batches = sample_clean(run, fp.sampler, plan, seeded_generator(cfg.seed, 0, run.rank, 1))
    collect_rewards(batches)
    scored = score_epoch(run, 0, batches, partial(forward_advantages, run), plan.groups)
    report_epoch(run, 0, fp.counters, scored)

    x0 = torch.cat([b.latents for b in scored.batches])
    cond = cond_cat([b.cond for b in scored.batches])
    adv = scored.advantages.to(x0.device)
    schedule = run.family.set_timesteps(fp.sampler.scheduler, cfg.sample_num_steps, x0)
    gen = seeded_generator(cfg.seed, 0, 0, 9)
    run.network.train()
    grads = []
    for i in range(len(x0)):
        batch = {"x0": x0[i : i + 1], "advantages": adv[i : i + 1]}
        c = {k: v[i : i + 1] for k, v in cond.items()}
        draw = draw_timesteps(run, fp.sampler.scheduler, schedule, batch["x0"], 1, gen)[0]
        loss, _ = NFT.loss(run, fp, batch, c, draw)
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


if __name__ == "__main__":
    main_for(noise_scale, preflight, NFTConfig, sys.argv[1:], __doc__)
