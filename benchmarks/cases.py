"""What is measured: each case's `setup(bench) -> (run, models)` builds what the kit's trainers build, and `run()`
does one timed unit of work through the kit's own functions (`models`: the modules whose gradient checkpointing
the FLOP count switches off)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.config import BenchConfig
from benchmarks.harness import Bench


@dataclass
class Case:
    name: str  # e.g. "refl lora b1"
    bench: str  # one of config.CASES
    unit: str  # what one run is
    images: int  # images per run (for the per-image column)
    settings: dict
    setup: Callable[[Bench], tuple[Callable[[], torch.Tensor], dict]]


def _text_encoder_bytes(family) -> int:
    """Device bytes of the family's text encoders' weights (each tensor a 512-byte block): what a trainer that kept
    them off the GPU would not hold."""
    from benchmarks.meta import round_block

    encoders = [getattr(family.pipe, n, None) for n in ("text_encoder", "text_encoder_2", "text_encoder_3")]
    tensors = [t for e in encoders if e is not None for t in (*e.parameters(), *e.buffers())]
    return sum(round_block(t.numel() * t.element_size()) for t in tensors)


def _flux_trainable(b: Bench, mode: str, config=None):
    """FLUX.1-dev's transformer with LoRA on the family's default targets (the kit's FLUX default) and its family."""
    from refl_ddpo.core.families.flux import Flux

    base, params = b.trainable_unet(
        mode, config, name="flux_transformer", targets=list(Flux.lora_target_modules)
    )
    family = b.flux_family(base)
    b.text_encoder_bytes = _text_encoder_bytes(family)
    b.text_encoder_family = family  # for the count of --offload_text_encoders (benchmarks/memory.py)
    return base, params, family


def refl_case(
    mode: str, batch: int, sd3_t5: bool | None = None, sdxl: bool = False, flux: bool = False
) -> Case:
    """One optimizer step of refl_ddpo.trainers.refl (its inner loop without logging), k fixed. `sd3_t5` not None:
    on SD3.5 Medium (with or without its T5 encoder) instead of SD v1.5; `sdxl`: on SDXL base 1.0; `flux`: on
    FLUX.1-dev (its embedded guidance at the pipeline's 3.5, as the trainer resolves it unset)."""

    def setup(b: Bench):
        from refl_ddpo.trainers.backprop import Rollout, draft_step, refl_step

        guidance = 1.0  # ReFL's rollout: CFG off
        if flux:
            base_unet, params, family = _flux_trainable(b, mode)
            scheduler = family.rollout_scheduler("ddpm")  # flow matching: its Euler sampler either way
            guidance = family.default_guidance_scale(guidance)
        elif sd3_t5 is None:
            base_unet, params = b.trainable_unet(mode, name="sdxl_unet" if sdxl else "unet")
            family = b.sdxl_family(base_unet) if sdxl else b.family(base_unet)
            # the ReFL trainer's default rollout sampler (ReFL.py's)
            scheduler = family.scheduler("DDPMScheduler")
        else:
            base_unet, params = b.trainable_unet(mode, name="sd3_transformer")
            family = b.sd3_family(base_unet, sd3_t5)
            scheduler = family.rollout_scheduler("ddpm")  # flow matching: its Euler sampler either way
        reward_model = b.build("reward")
        unet, optimizer = b.prepare(base_unet, params, None)
        b.finish(unet, family.vae, reward_model)
        reward, acc, k = b.imagereward(reward_model), b.accelerator, b.cfg.refl_k
        # DRaFT-K (--refl_backprop_steps K): the whole run, the last K steps with grad
        step_fn, k = (draft_step, b.cfg.refl_backprop_steps) if b.cfg.refl_backprop_steps else (refl_step, k)
        unet.train()

        def run():
            prompts, metadata = b.prompts(batch)
            with acc.accumulate(unet):
                cond, _ = family.encode_prompts(prompts, with_negative=False)
                noise = family.initial_noise(batch, b.resolution, b.generator, cond["prompt_embeds"].dtype)
                rollout = Rollout(
                    family,
                    scheduler,
                    cond,
                    None,
                    prompts,
                    metadata,
                    noise,
                    b.cfg.refl_steps,
                    guidance,
                    generator=b.generator,
                    network=unet,
                )
                out = step_fn(rollout, reward, k, grad_scale=b.cfg.grad_scale)
                acc.backward(out.loss)
                acc.clip_grad_norm_(params, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            return out.loss.detach()

        return run, {"unet": base_unet, "vae": family.vae, "reward": reward_model}

    if flux:
        settings = {"mode": mode, "batch": batch, "model": "flux.1-dev", "guidance_scale": 3.5}
        return Case(f"flux_refl {mode} b{batch}", "flux_refl", "optimizer step", batch, settings, setup)
    if sdxl:
        settings = {"mode": mode, "batch": batch, "model": "sdxl-base-1.0"}
        return Case(f"sdxl_refl {mode} b{batch}", "sdxl_refl", "optimizer step", batch, settings, setup)
    if sd3_t5 is None:
        return Case(
            f"refl {mode} b{batch}", "refl", "optimizer step", batch, {"mode": mode, "batch": batch}, setup
        )
    name = f"sd35m_refl {mode} b{batch} {'with' if sd3_t5 else 'without'} T5"
    settings = {"mode": mode, "batch": batch, "t5": sd3_t5, "model": "sd3.5-medium"}
    return Case(name, "sd35m_refl", "optimizer step", batch, settings, setup)


FLUX_GRPO_ETA = 0.7  # the flow SDE's noise level of the kit's GRPO (Flow-GRPO's default); no effect on memory


def _ddpo_setup(b: Bench, flux: bool = False):
    """The DDPO trainer's models: the family with a DDIM scheduler, LoRA UNet prepared with its optimizer, and the
    empty prompt's conditioning (batch 1). `flux`: GRPO's on FLUX.1-dev (the family's policy sampler, the flow SDE;
    the LoRA on the family's default targets)."""
    if flux:
        config = b.ddpo_config(eta=FLUX_GRPO_ETA)
        base_unet, params, family = _flux_trainable(b, "lora", config)
        scheduler = family.policy_scheduler()
    else:
        config = b.ddpo_config()
        base_unet, params = b.trainable_unet("lora", config)
        family = b.family(base_unet)
        scheduler = family.scheduler("DDIMScheduler")
    return policy_setup(b, config, family, scheduler, params)


def policy_setup(b: Bench, config, family, scheduler, params):
    """The rest of the DDPO / GRPO trainer's setup once its family (around the trained network) and trained
    parameters are built: `scheduler` as the family's, the network prepared with its optimizer, the empty prompt's
    conditioning. Returns what `sample_run` and `train_run` take."""
    from refl_ddpo.trainers.ddpo_config import num_train_timesteps

    family.pipe.scheduler = scheduler
    unet, optimizer = b.prepare(
        family.network, params, config, config.train_gradient_accumulation_steps * num_train_timesteps(config)
    )
    b.finish(unet, family.vae)
    uncond = family.empty_cond()
    return config, family, scheduler, unet, optimizer, params, uncond


def _pixel_mean_reward():
    """A stand-in reward for DDPO timing (JPEG size, aesthetic or ImageReward would add their own cost)."""
    from refl_ddpo.rewards import Reward

    return Reward("pixel_mean", lambda images, prompts, metadata: (images.flatten(1).mean(1), {}), False)


def _sample(b: Bench, config, family, scheduler, unet, uncond, prompt_fn, reward):
    """refl_ddpo.trainers.rollouts.sample_epoch for the one batch of `config`, as the DDPO trainer calls it."""
    from refl_ddpo.trainers.epochs import EpochPlan
    from refl_ddpo.trainers.rollouts import Policy, SampleSettings, sample_epoch

    return sample_epoch(
        Policy(family, scheduler, uncond, unet, b.accelerator.autocast),
        SampleSettings.from_config(config),
        EpochPlan(prompt_fn),
        reward,
        b.generator,
    )


def sample_run(b: Bench, setup: tuple) -> tuple:
    """One sampled batch (refl_ddpo.trainers.rollouts.sample_epoch) on `setup`, `policy_setup`'s result."""
    config, family, scheduler, unet, _, _, uncond = setup
    reward = _pixel_mean_reward()

    def run():
        unet.eval()
        return _sample(b, config, family, scheduler, unet, uncond, b.prompt_fn, reward)[0].images

    return run, {"unet": family.network, "vae": family.vae}


def train_run(b: Bench, setup: tuple) -> tuple:
    """One training pass (refl_ddpo.trainers.ppo.train_on_samples) over one sampled batch on `setup`,
    `policy_setup`'s result; CFG where the config samples with it."""
    from refl_ddpo.trainers.ppo import PPOSettings, train_on_samples
    from refl_ddpo.trainers.rollouts import Policy, collect_rewards, stack_samples

    config, family, scheduler, unet, optimizer, params, uncond = setup
    # One sampled batch to train on (not timed); advantages random in [-5, 5] (adv_clip_max).
    batches = _sample(b, config, family, scheduler, unet, uncond, b.prompt_fn, _pixel_mean_reward())
    collect_rewards(batches)
    advantages = torch.randn(config.sample_batch_size, generator=b.generator).clamp(-5, 5)  # (B,)
    samples = stack_samples(batches, advantages)
    del batches
    train_uncond = uncond if config.train_cfg and config.sample_guidance_scale > 1.0 else None
    policy, settings = Policy(family, scheduler, train_uncond, unet), PPOSettings.from_config(config)

    def run():
        steps = train_on_samples(policy, settings, samples, b.accelerator, optimizer, params, b.generator)
        return torch.tensor([s["loss"] for s in steps])

    return run, {"unet": family.network}


def ddpo_sample_case(batch: int, flux: bool = False) -> Case:
    """refl_ddpo.trainers.rollouts.sample_epoch for one batch: 50 stochastic DDIM steps, CFG, log-probs, decode.
    `flux`: GRPO's sampling on FLUX.1-dev (the same function: flow SDE steps at the embedded guidance, no CFG)."""

    def setup(b: Bench):
        return sample_run(b, _ddpo_setup(b, flux))

    if flux:
        return Case(
            f"flux_grpo_sample b{batch}", "flux_grpo_sample", "sampled batch", batch, {"batch": batch}, setup
        )
    return Case(f"ddpo_sample b{batch}", "ddpo_sample", "sampled batch", batch, {"batch": batch}, setup)


def ddpo_train_case(batch: int, micro: int, flux: bool = False) -> Case:
    """refl_ddpo.trainers.ppo.train_on_samples over one sampled batch: every timestep, CFG, PPO-clip. `flux`:
    GRPO's training pass on FLUX.1-dev (the same function; no CFG: one transformer call per trained step)."""

    def setup(b: Bench):
        return train_run(b, _ddpo_setup(b, flux))

    bench = "flux_grpo_train" if flux else "ddpo_train"
    return Case(
        f"{bench} b{batch}",
        bench,
        "training pass",
        batch,
        {"batch": batch, "micro_batch": micro},
        setup,
    )


def inference_case(batch: int) -> Case:
    """refl_ddpo.core.generate.generate_batch: text encoder, 50 DDIM steps with CFG, decode (weights in dtype)."""

    def setup(b: Bench):
        from refl_ddpo.core.generate import generate_batch

        family = b.family(b.build("unet"))
        family.pipe.scheduler = family.scheduler(
            "DDIMScheduler"
        )  # as load_inference_family sets --scheduler ddim
        b.finish(family.network, family.vae)
        prompt_fn = b.prompt_fn

        def run():
            prompts = [prompt_fn()[0] for _ in range(batch)]
            seeds = torch.randint(2**31, (batch,), generator=b.generator).tolist()
            return generate_batch(
                family,
                prompts,
                seeds,
                b.resolution,
                b.cfg.inference_steps,
                b.cfg.inference_guidance_scale,
                eta=0.0,
            )

        return run, {"unet": family.network, "vae": family.vae}

    return Case(f"inference b{batch}", "inference", "batch", batch, {"batch": batch}, setup)


def forward_case(name: str) -> Case:
    """One no-grad forward of one model: that the architecture builds and runs, and what it costs."""

    def setup(b: Bench):
        model = b.build(name)
        b.finish(**({name: model} if name in ("unet", "vae", "reward") else {}))
        side = b.resolution // b.vae_scale_factor
        gen, dev, dt = b.generator, b.device, b.dtype

        def run():
            with torch.no_grad():
                if name == "unet":
                    shape = (1, b.configs["unet"]["in_channels"], side, side)
                    states = torch.randn(
                        1,
                        b.configs["text_encoder"]["max_position_embeddings"],
                        b.configs["unet"]["cross_attention_dim"],
                        generator=gen,
                    )
                    return model(
                        torch.randn(shape, generator=gen).to(dev, dt),
                        999,
                        encoder_hidden_states=states.to(dev, dt),
                        return_dict=False,
                    )[0]
                if name == "vae":
                    latents = torch.randn(1, b.configs["vae"]["latent_channels"], side, side, generator=gen)
                    return model.decode(latents.to(dev, dt), return_dict=False)[0]
                if name == "text_encoder":
                    ids = b.clip_tokenizer(
                        b.prompts(1)[0],
                        padding="max_length",
                        max_length=77,
                        truncation=True,
                        return_tensors="pt",
                    ).input_ids
                    return model(ids.to(dev))[0]
                ids, mask = model.tokenize(b.prompts(1)[0])
                pixels = torch.rand(1, 3, model.image_size, model.image_size, generator=gen)
                return model(ids, mask, pixels.to(dev))

        return run, {name: model}

    return Case(f"forward {name}", "forward", "forward", 1, {"model": name}, setup)


def _bench_cases(cfg: BenchConfig, bench: str) -> list[Case]:
    """The cases of one --only entry."""
    refl_grid = [(m, bs) for m in cfg.refl_modes for bs in cfg.refl_batch_sizes]
    sample, micro = cfg.ddpo_sample_batch_size, cfg.ddpo_train_batch_size
    builders = {
        "refl": lambda: [refl_case(m, bs) for m, bs in refl_grid],
        "ddpo_sample": lambda: [ddpo_sample_case(sample)],
        "ddpo_train": lambda: [ddpo_train_case(sample, micro)],
        "inference": lambda: [inference_case(bs) for bs in cfg.inference_batch_sizes],
        "sd35m_refl": lambda: [refl_case(m, bs, t5) for t5 in (False, True) for m, bs in refl_grid],
        "sdxl_refl": lambda: [refl_case(m, bs, sdxl=True) for m, bs in refl_grid],
        "flux_refl": lambda: [refl_case(m, bs, flux=True) for m, bs in refl_grid],
        "flux_grpo_sample": lambda: [ddpo_sample_case(sample, flux=True)],
        "flux_grpo_train": lambda: [ddpo_train_case(sample, micro, flux=True)],
        "forward": lambda: [forward_case(n) for n in ("unet", "vae", "text_encoder", "reward")],
    }
    return builders[bench]()


def _record_steps(cfg: BenchConfig, case: Case) -> None:
    """The step counts (and sampler settings) of this config in the case's settings, for the JSON."""
    if case.bench in ("refl", "sd35m_refl", "sdxl_refl", "flux_refl"):
        case.settings.update(steps=cfg.refl_steps, k=cfg.refl_k, unet_calls=cfg.refl_k + 1, sampler="ddpm")
        if cfg.refl_backprop_steps:
            del case.settings["k"]
            case.settings.update(backprop_steps=cfg.refl_backprop_steps, unet_calls=cfg.refl_steps)
    elif case.bench.startswith("ddpo"):
        case.settings.update(steps=cfg.ddpo_steps, guidance_scale=cfg.ddpo_guidance_scale, eta=1.0)
    elif case.bench.startswith("flux_grpo"):  # the embedded guidance; the flow SDE's noise level
        case.settings.update(
            steps=cfg.ddpo_steps,
            guidance_scale=cfg.ddpo_guidance_scale,
            eta=FLUX_GRPO_ETA,
            model="flux.1-dev",
        )
    elif case.bench == "inference":
        case.settings.update(steps=cfg.inference_steps, guidance_scale=cfg.inference_guidance_scale, eta=0.0)


def make_cases(cfg: BenchConfig) -> list[Case]:
    cases = [case for bench in cfg.cases for case in _bench_cases(cfg, bench)]
    for case in cases:
        _record_steps(cfg, case)
    return cases
