"""Wan image-to-video: Wan 2.1 I2V (e.g. Wan-AI/Wan2.1-I2V-14B-480P-Diffusers) and Wan 2.2 I2V A14B, as diffusers'
`WanImageToVideoPipeline` draws them: everything of Wan text-to-video (families/wan.py: the prompt encoding, the
noise, CFG, the two experts, the Euler / SDE steps, the decode) plus the first frame, built as the stock pipeline
builds it, per sample:

- the condition (B, 4 + 16, T, h, w): the image resized to the video's size (`video_processor.preprocess`, to
  [-1, 1]) as the first frame of a video whose other num_frames - 1 frames are zeros, VAE-encoded (the latent
  distribution's mode), normalised as the latents are ((z - latents_mean) / latents_std); before it the first-frame
  mask, 1 on the first latent frame and 0 after it (the pipeline's `mask_lat_size`, its first pixel frame repeated
  4 times so that it fills a latent frame). At every network call it follows the 16 noisy channels: the transformer
  reads 36 (`in_channels`); the two calls of CFG see the same condition;
- Wan 2.1 only (a transformer with `image_dim`): the image read by the pipeline's CLIP vision `image_encoder` through
  its `image_processor`, the penultimate hidden state (`encode_image`), given to the transformer as
  `encoder_hidden_states_image` (both calls of CFG). Wan 2.2 I2V has no image encoder.

Both travel in the conditioning ("image_condition", float32 as the pipeline keeps it; "image_embeds"), encoded once
per batch beside the prompt's embeddings, so the trainers' sample buffers carry them as any conditioning tensor.

The image is each sample's one source image (`metadata["source_images"]`: --edit_data, whose instruction is the
prompt). It is resized to the run's square --resolution (`video_resolution`, set by the trainers and inference), as
the stock pipeline resizes any image to the height and width it is asked for: a user gives the photos they have and
gets videos of the size they train at. The stock pipeline animates one image per call; a batch here gives each sample
its own, encoded one by one (each the stock call of batch 1). Wan 2.2 TI2V-5B with an image (`expand_timesteps`: the
first latent frame replaced by the image's latent, its tokens at timestep 0) is not covered: such a folder is refused.
"""

from __future__ import annotations

import torch

from refl_ddpo.core.edit_data import source_tensors, to_pil
from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families.base import Cond
from refl_ddpo.core.families.wan import Wan


class WanI2V(Wan):
    name = "wan_i2v"
    pipeline_class = "WanImageToVideoPipeline"
    edits_images = True
    needs_source_images = True  # no video without its first frame: --edit_data is required (check_edit_data)

    def __init__(self, pipe):
        super().__init__(pipe)
        if pipe.config.get("expand_timesteps", False):
            raise UserError(
                "Wan 2.2 TI2V-5B's image-to-video (expand_timesteps) is not supported; train it as text-to-video "
                "(a WanPipeline folder) or use a Wan 2.1 / 2.2 I2V model."
            )
        self.video_resolution = self.native_resolution  # the videos' side in pixels: the run's --resolution

    def encode_conditioning(
        self, prompts: list[str], metadata: list[dict] | None, with_negative: bool
    ) -> tuple[Cond, Cond | None]:
        """The prompts' embeddings, the first frames' condition and (Wan 2.1) their CLIP embeddings (module doc)."""
        sources = [source_tensors(m) for m in metadata or [{}] * len(prompts)]
        if not all(len(s) == 1 for s in sources):
            counts = sorted({len(s) for s in sources})
            raise UserError(
                f"Wan image-to-video animates one image per prompt, and this batch has {counts} per sample; give "
                "each --edit_data line one 'image'."
            )
        cond, uncond = self.encode_prompts(prompts, with_negative)
        images = [to_pil(s[0]) for s in sources]
        with torch.no_grad():
            cond["image_condition"] = torch.cat([self.first_frame_condition(im) for im in images])
            if self.pipe.transformer.config.image_dim is not None:  # Wan 2.1: the CLIP image embeddings too
                device = self.pipe.device
                embeds = [self.pipe.encode_image(im, device) for im in images]  # (1, L, D) each
                cond["image_embeds"] = torch.cat(embeds).to(cond["prompt_embeds"].dtype)
        return cond, uncond

    def first_frame_condition(self, image) -> torch.Tensor:
        """One image (PIL) -> its condition (1, 4 + 16, T, h, w) float32: the first-frame mask, then the normalised
        latents of the image followed by num_frames - 1 black frames, as the pipeline's `prepare_latents`."""
        from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents

        pipe, vae, side = self.pipe, self.vae, self.video_resolution
        pixels = pipe.video_processor.preprocess(image, height=side, width=side)  # (1, 3, H, W) in [-1, 1]
        frames = pixels.to(pipe.device, torch.float32).unsqueeze(2)  # (1, 3, 1, H, W)
        video = torch.cat([frames, frames.new_zeros(1, 3, self.num_frames - 1, side, side)], dim=2)
        z = retrieve_latents(vae.encode(video.to(vae.dtype)), sample_mode="argmax").float()
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(z.device)
        z = (z - mean) * inv_std  # (1, 16, T, h, w)
        stride = pipe.vae_scale_factor_temporal
        mask = torch.zeros(1, 1, self.num_frames, *z.shape[3:], device=z.device)
        mask[:, :, 0] = 1  # the first frame is given
        mask = torch.cat([mask[:, :, :1].repeat_interleave(stride, dim=2), mask[:, :, 1:]], dim=2)
        mask = mask.view(1, -1, stride, *z.shape[3:]).transpose(1, 2)  # (1, 4, T, h, w)
        return torch.cat([mask, z], dim=1)

    def network_inputs(self, net, latents, t, cond: Cond) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """The noisy latents followed by the image condition on the channels (B, 36, T, h, w), and (Wan 2.1) the
        CLIP embeddings as `encoder_hidden_states_image`."""
        if "image_condition" not in cond:
            raise UserError(
                "Wan image-to-video draws from a first frame: give the prompts their images with --edit_data (and "
                "--validation_prompts_file, if set, as edit records too)."
            )
        condition = cond["image_condition"].to(latents.device)
        x = torch.cat([latents.float(), condition], dim=1).to(cond["prompt_embeds"].dtype)
        extra = {"encoder_hidden_states_image": cond["image_embeds"]} if "image_embeds" in cond else {}
        return x, t, extra
