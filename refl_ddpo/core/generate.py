"""Generation: which images to draw (`plan_images`: prompt, image index, seed) and drawing a batch of them
(`generate_batch`), shared by inference (`refl_ddpo.apps.inference`), validation during training (`refl_ddpo.run.validation`)
and the toy world's checks.

The images come from the shared loop (`refl_ddpo.core.sampling`) on the model family's adapter (`refl_ddpo.core.families`);
nothing here is a copy of a pipeline.

Seeds: image j of prompt i is drawn from its own CPU generator seeded `seed + i * num_images_per_prompt + j` (the
stochastic scheduler steps, with eta > 0, use the same generator). Its starting noise therefore depends only on that
seed, not on the batch it ran in nor on which script ran it, so both inference scripts (and validation) draw the same
noise for the same (prompt, seed); with the same batch size the images are bit-identical run to run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

IMAGE_FILE = re.compile(r"\d{4,}_\d{2,}_seed-?\d+\.png")  # ImageSpec.file


@dataclass(frozen=True)
class ImageSpec:
    """One image to generate: prompt i, image j of it, and its own seed."""

    prompt_index: int
    image_index: int
    prompt: str
    metadata: dict
    seed: int

    @property
    def file(self) -> str:
        return f"{self.prompt_index:04d}_{self.image_index:02d}_seed{self.seed}.png"


def plan_images(prompts: list[tuple[str, dict]], num_images_per_prompt: int, seed: int) -> list[ImageSpec]:
    """Every (prompt, image) pair in order, image j of prompt i seeded seed + i * num_images_per_prompt + j."""
    return [
        ImageSpec(i, j, prompt, metadata, seed + i * num_images_per_prompt + j)
        for i, (prompt, metadata) in enumerate(prompts)
        for j in range(num_images_per_prompt)
    ]


def generate_batch(
    family,
    prompts: list[str],
    seeds: list[int],
    resolution: int,
    num_inference_steps: int,
    guidance_scale: float,
    eta: float = 0.0,
    scheduler=None,
    metadata: list[dict] | None = None,
) -> torch.Tensor:
    """Images (B, 3, H, W) float32 in [0, 1] on the model's device; image b from a CPU generator seeded seeds[b].
    `scheduler`: the sampler to run (default: `family.pipe.scheduler`); its timesteps are set here. `metadata`:
    the prompts' metadata, which carries an edit's source images (`ModelFamily.encode_conditioning`).

    Runs in inference mode: no autograd graph is kept (the pipeline's memory for one no-grad forward), even if
    LoRA parameters require grad. A network sharded with FSDP2 (--fsdp) runs under no_grad instead: the whole
    weights it gathers for a forward must not become inference tensors, which training could not reuse.
    """
    from torch.distributed.fsdp import FSDPModule

    mode = torch.no_grad() if isinstance(family.network, FSDPModule) else torch.inference_mode()
    with mode:
        return _generate_batch(
            family, prompts, seeds, resolution, num_inference_steps, guidance_scale, eta, scheduler, metadata
        )


def _generate_batch(
    family, prompts, seeds, resolution, num_inference_steps, guidance_scale, eta, scheduler, metadata
):
    from refl_ddpo.core.sampling import denoise

    # CPU generators: the same seed gives the same noise on any device (diffusers' randn_tensor draws on the CPU
    # and moves); a list gives each image its own stream, whatever the batch.
    generators = [torch.Generator("cpu").manual_seed(s) for s in seeds]
    cond, uncond = family.encode_conditioning(prompts, metadata, with_negative=guidance_scale > 1.0)
    dtype = next(iter(cond.values())).dtype
    noise = family.initial_noise(len(prompts), resolution, generators, dtype)  # as the pipeline draws it
    out = denoise(
        family,
        family.pipe.scheduler if scheduler is None else scheduler,
        cond,
        uncond,
        noise,
        num_inference_steps,
        guidance_scale=guidance_scale,
        eta=eta,
        generator=generators,
    )
    return family.decode(out.latents)  # (B, 3, H, W)
