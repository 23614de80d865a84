"""Tiny random models in the checkpoint/ layout, for tests and the demo on machines with no hub access.

    python -m refl_ddpo.testing.tiny OUT      (or python -m refl_ddpo.tiny OUT, or refl-ddpo-tiny OUT)

writes
    OUT/stable-diffusion/   diffusers layout (unet, vae, text_encoder, tokenizer, scheduler, model_index.json)
    OUT/tiny-sd3/           Stable Diffusion 3 layout (transformer, 16-channel vae, two CLIP text encoders and
                            a T5 with their tokenizers, flow-matching scheduler)
    OUT/tiny-sdxl/          Stable Diffusion XL layout (UNet with added text / time conditions, vae, text_encoder
                            and text_encoder_2 with their tokenizers, Euler scheduler)
    OUT/tiny-flux/, OUT/tiny-flux-schnell/   FLUX.1 layout, dev-like (guidance embedding) and schnell-like
                            (refl_ddpo.testing.tiny_flux); OUT/tiny-flux-kontext/: FLUX.1 Kontext (editing)
    OUT/tiny-qwen-image/    Qwen-Image layout: Qwen2.5-VL text encoder and Qwen2 tokenizer built offline,
                            the Qwen-Image VAE (refl_ddpo.testing.tiny_qwen); OUT/tiny-qwen-image-edit-plus/: its
                            editing pipeline, a Qwen2.5-VL with a vision tower and a Qwen2VLProcessor
    OUT/tiny-z-image/, OUT/tiny-z-image-turbo/   Z-Image layout: Qwen3 text encoder and Qwen2 tokenizer built
                            offline, base-like and Turbo-like schedulers (refl_ddpo.testing.tiny_zimage)
    OUT/tiny-flux2/, OUT/tiny-flux2-klein/, OUT/tiny-flux2-klein-base/   FLUX.2 [dev] and [klein] (distilled, base)
                            layouts: Mistral3 / Qwen3 text encoders and tokenizers built offline (tiny_flux2)
    OUT/tiny-wan21/, OUT/tiny-wan22/   Wan 2.1 / Wan 2.2 (two experts) text-to-video layouts: UMT5 and its T5
                            tokenizer built offline, the 3-D VAE (refl_ddpo.testing.tiny_wan);
                            OUT/tiny-wan21-i2v/, OUT/tiny-wan22-i2v/: their image-to-video layouts (Wan 2.1's
                            with a tiny CLIP vision encoder and its image processor)
    OUT/ImageReward.pt      official key layout, tiny dims
    OUT/med_config.json
    OUT/bert-base-uncased/  a plain BERT tokenizer folder
    OUT/aesthetic/          tiny CLIP ViT + LAION-style linear head (see refl_ddpo.rewards.aesthetic)
    OUT/pickscore/, OUT/clip_score/   tiny CLIPModel + processor folders (refl_ddpo.rewards.clip)
    OUT/hpsv2/              tiny open_clip ViT in the 'local-dir' layout (refl_ddpo.rewards.hpsv2)
    OUT/bertscore/          tiny BERT for vlm_bertscore's BERTScore recall (refl_ddpo.rewards.vlm)
    OUT/hpsv3/              tiny Qwen2-VL HPSv3: HPSv3.safetensors + Qwen2-VL-7B-Instruct/ (refl_ddpo.rewards.hpsv3)
(the reward models' writers are in refl_ddpo.testing.tiny_rewards)

Same code paths and file layouts as the real weights, random values from fixed seeds, a few MB, a few seconds.
The models are random: images are noise and rewards mean nothing except that they can be optimised.

    python -m refl_ddpo.testing.tiny OUT --denoiser_steps 800

also writes OUT/stable-diffusion-denoiser/: the same VAE and text encoder with a smaller UNet trained for that many
steps (about 0.1 s each on one core) to denoise a toy latent distribution, smooth random fields whose grain varies
from sample to sample. Its images differ in how much detail they have, from flat to busy, as real SD's do, so a
reward on detail (JPEG size) has something to select: DDPO's test of learning runs on it. A random UNet's images are
all equally noisy (JPEG sizes within a few bytes of each other), and no policy gradient can be seen on them.

    python -m refl_ddpo.testing.tiny OUT --toy_world

also writes the toy world (refl_ddpo.toy_world.world: coloured shapes on grey, prompts "a {colour} {shape}"):
OUT/toy-sd/ (a tiny Stable Diffusion trained to draw them, deliberately imperfect), OUT/toy-sd3/ (the same world
as a tiny SD3: an MMDiT trained by flow matching, two CLIPs, no T5) and
OUT/toy_classifier.{safetensors,json} (the toy_classifier reward's CNN), copied from the weights committed under
toy_world.DATA_DIR after checking their SHA256SUMS (a mismatch exits 2). `--rebuild_toy_world` trains them
from scratch instead (refl_ddpo.testing.toy_build; about 35 minutes on one core; same weights only on the same CPU
kind).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from refl_ddpo.testing.tiny_parts import (
    SD_SCHEDULER_CONFIG,
    clip_tokenizer,
    tiny_clip_config,
    tiny_t5,
    tiny_vae,
)


def toy_latents(n: int, side: int, generator: torch.Generator) -> torch.Tensor:
    """(n, 4, side, side) smooth random fields: N(0, 1) on a c x c grid, c one of side/8, side/4, side/2, side drawn
    per sample, bicubic-upsampled to side x side and scaled to unit std per sample (coarse grids decode to flat
    images, fine ones to busy images)."""
    import torch.nn.functional as F

    grids = (side // 8, side // 4, side // 2, side)
    choice = torch.randint(0, len(grids), (n,), generator=generator)
    fields = torch.empty(n, 4, side, side)
    for k, c in enumerate(grids):
        idx = (choice == k).nonzero().flatten()
        z = torch.randn(len(idx), 4, c, c, generator=generator)
        fields[idx] = F.interpolate(z, size=side, mode="bicubic", align_corners=False) if c < side else z
    return fields / fields.std(dim=(1, 2, 3), keepdim=True)


def train_toy_denoiser(pipe, steps: int, seed: int = 0, batch_size: int = 32, lr: float = 2e-3) -> None:
    """Train `pipe.unet` for `steps` AdamW steps on the usual epsilon-prediction loss over all training timesteps,
    on `toy_latents` (text embeddings of a few prompts and of "" as conditions; the data ignores them)."""
    import torch.nn.functional as F
    from diffusers import DDPMScheduler
    from tqdm.auto import tqdm

    noise_scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        conds = pipe.encode_prompt([f"prompt {i}" for i in range(16)] + [""], "cpu", 1, False)[0]
    unet, side = pipe.unet, pipe.unet.config.sample_size
    unet.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=lr, weight_decay=0.0)
    for _ in tqdm(range(steps), desc="tiny denoiser", leave=False):
        x0 = toy_latents(batch_size, side, g)
        noise = torch.randn(x0.shape, generator=g)
        t = torch.randint(0, noise_scheduler.config.num_train_timesteps, (batch_size,), generator=g)
        cond = conds[torch.randint(0, len(conds), (batch_size,), generator=g)]
        pred = unet(
            noise_scheduler.add_noise(x0, noise, t), t, encoder_hidden_states=cond, return_dict=False
        )[0]
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(pred, noise).backward()
        optimizer.step()
    unet.eval().requires_grad_(False)


def write_tiny_stable_diffusion(out: Path, seed: int = 0, denoiser_steps: int = 0) -> Path:
    """A StableDiffusionPipeline folder with tiny random UNet / VAE / CLIP text encoder; returns its path.

    `denoiser_steps` > 0: OUT/stable-diffusion-denoiser instead, with a smaller UNet (16, 32 channels) trained that
    many steps by `train_toy_denoiser`.
    """
    from diffusers import PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    out = Path(out)
    tokenizer = clip_tokenizer()

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(16, 32) if denoiser_steps else (32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8 if denoiser_steps else 32,
    )
    vae = tiny_vae(seed + 1, 4)
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(tiny_clip_config(tokenizer))
    pipe = StableDiffusionPipeline(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=PNDMScheduler.from_config(SD_SCHEDULER_CONFIG),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    if denoiser_steps:
        train_toy_denoiser(pipe, denoiser_steps, seed)
    sd_dir = out / ("stable-diffusion-denoiser" if denoiser_steps else "stable-diffusion")
    pipe.save_pretrained(sd_dir, safe_serialization=True)
    return sd_dir


def write_tiny_stable_diffusion_3(out: Path, seed: int = 0) -> Path:
    """OUT/tiny-sd3/: a StableDiffusion3Pipeline folder with a tiny random MMDiT (SD3Transformer2DModel), a
    16-channel VAE with SD3's shift and scaling factors, two CLIP text encoders with projection and a T5 encoder
    (each with its tokenizer, built offline), SD3's flow-matching scheduler (shift 3.0). Native resolution 32
    (16 x 16 latents, 8 x 8 patches)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    tokenizer = clip_tokenizer()
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,  # = num_attention_heads * attention_head_dim
        joint_attention_dim=64,  # T5's width; the two CLIPs' hidden states side by side (32 + 32) match it
        pooled_projection_dim=64,  # the two CLIPs' pooled projections side by side (32 + 32)
        pos_embed_max_size=32,
    )
    vae = tiny_vae(
        seed + 1,
        16,
        scaling_factor=1.5305,  # SD3's
        shift_factor=0.0609,  # SD3's
        use_quant_conv=False,  # SD3's VAE has none
        use_post_quant_conv=False,
    )
    text_encoders = []
    for k in range(2):
        torch.manual_seed(seed + 2 + k)
        text_encoders.append(CLIPTextModelWithProjection(tiny_clip_config(tokenizer, projection_dim=32)))
    t5_tok, t5 = tiny_t5(seed + 4)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoders[0],
        tokenizer=tokenizer,
        text_encoder_2=text_encoders[1],
        tokenizer_2=tokenizer,
        text_encoder_3=t5,
        tokenizer_3=t5_tok,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
    )
    sd3_dir = Path(out) / "tiny-sd3"
    pipe.save_pretrained(sd3_dir, safe_serialization=True)
    return sd3_dir


def write_tiny_stable_diffusion_xl(out: Path, seed: int = 0) -> Path:
    """OUT/tiny-sdxl/: a StableDiffusionXLPipeline folder with a tiny random UNet taking SDXL's added conditions
    ("text_time": the pooled text and 6 time ids), a VAE with SDXL's scaling factor and force_upcast, a CLIPTextModel
    and a CLIPTextModelWithProjection (each with its tokenizer, built offline), SDXL base's Euler scheduler settings
    and force_zeros_for_empty_prompt. Native resolution 32 (16 x 16 latents)."""
    from diffusers import EulerDiscreteScheduler

    torch.manual_seed(seed)
    unet = _tiny_sdxl_unet(sample_size=16, layers_per_block=1)
    vae = tiny_vae(
        seed + 1,
        4,
        scaling_factor=0.13025,  # SDXL's
        force_upcast=True,  # SDXL's: decoded in float32 when the VAE is float16
    )
    scheduler = EulerDiscreteScheduler.from_config({**SD_SCHEDULER_CONFIG, "timestep_spacing": "leading"})
    return _save_sdxl(Path(out) / "tiny-sdxl", unet, vae, scheduler, seed)


def write_tiny_sdxl_diffusers_config(out: Path, seed: int = 0) -> Path:
    """OUT/tiny-sdxl-diffusers-config/: the tiny SDXL as diffusers' own SDXL pipeline tests build theirs
    (tests/pipelines/stable_diffusion_xl/test_stable_diffusion_xl.py, get_dummy_components): the UNet of
    `write_tiny_stable_diffusion_xl` with 2 layers per block and sample_size 32, a VAE of sample_size 128 and the
    default scaling factor 0.18215, and an Euler scheduler whose config has no set_alpha_to_one (so a DDIM scheduler
    made from it takes DDIM's default, true: its last step goes to a_prev = 1, deterministic; issue #72)."""
    from diffusers import EulerDiscreteScheduler

    torch.manual_seed(seed)
    unet = _tiny_sdxl_unet(sample_size=32, layers_per_block=2)
    # AutoencoderKL's defaults: scaling_factor 0.18215, force_upcast
    vae = tiny_vae(seed + 1, 4, sample_size=128)
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        steps_offset=1,
        beta_schedule="scaled_linear",
        timestep_spacing="leading",
    )
    return _save_sdxl(Path(out) / "tiny-sdxl-diffusers-config", unet, vae, scheduler, seed)


def _tiny_sdxl_unet(sample_size: int, layers_per_block: int):
    """The tiny SDXL UNet (random, from torch's current seed): two blocks, the second with cross-attention."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=sample_size,
        in_channels=4,
        out_channels=4,
        layers_per_block=layers_per_block,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2),  # SDXL's grow with depth (1, 2, 10)
        attention_head_dim=(2, 4),
        use_linear_projection=True,  # SDXL's
        cross_attention_dim=64,  # the two CLIPs' hidden states side by side (32 + 32)
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + 32,  # 6 time ids x 8 + the pooled projection (32)
        norm_num_groups=32,
    )


def _save_sdxl(folder: Path, unet, vae, scheduler, seed: int) -> Path:
    """Save a StableDiffusionXLPipeline of these parts and two tiny CLIPs (drawn from seed + 2 and seed + 3, the
    second with a projection of 32) with the offline tokenizer, force_zeros_for_empty_prompt, in `folder`."""
    from diffusers import StableDiffusionXLPipeline
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    tokenizer = clip_tokenizer()
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(tiny_clip_config(tokenizer))
    torch.manual_seed(seed + 3)
    text_encoder_2 = CLIPTextModelWithProjection(tiny_clip_config(tokenizer, projection_dim=32))
    pipe = StableDiffusionXLPipeline(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        scheduler=scheduler,
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def write_tiny_models(out: str | Path, seed: int = 0, denoiser_steps: int = 0) -> Path:
    """Everything `checkpoint/` holds, tiny and random, under `out` (+ the trained tiny denoiser, see above)."""
    from refl_ddpo.testing import tiny_flux, tiny_flux2, tiny_qwen, tiny_rewards, tiny_wan, tiny_zimage

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_tiny_stable_diffusion(out, seed)
    write_tiny_stable_diffusion_3(out, seed)
    write_tiny_stable_diffusion_xl(out, seed)
    tiny_flux.write_tiny_flux(out, seed)
    tiny_flux.write_tiny_flux_kontext(out, seed)
    tiny_qwen.write_tiny_qwen_image(out, seed)
    tiny_qwen.write_tiny_qwen_image_edit_plus(out, seed)
    tiny_zimage.write_tiny_z_image(out, seed)
    tiny_flux2.write_tiny_flux2(out, seed)
    tiny_wan.write_tiny_wan(out, seed)
    tiny_wan.write_tiny_wan_i2v(out, seed)
    tiny_rewards.write_imagereward(out, seed=seed)
    tiny_rewards.write_aesthetic(out / "aesthetic", seed=seed)
    tiny_rewards.write_clip(out, seed=seed)
    tiny_rewards.write_hpsv2(out, seed=seed)
    tiny_rewards.write_bertscore(out, seed=seed)
    tiny_rewards.write_hpsv3(out, seed=seed)
    if denoiser_steps:
        write_tiny_stable_diffusion(out, seed, denoiser_steps)
    return out


def write_toy_world(out: str | Path, rebuild: bool = False) -> Path:
    """OUT/toy-sd/, OUT/toy-sd3/ and OUT/toy_classifier.{safetensors,json}: the committed toy world (checked against
    SHA256SUMS), or retrained from scratch with `rebuild` (refl_ddpo.testing.toy_build.build_toy_world; about 35
    minutes on one core). Returns OUT/toy-sd."""
    if rebuild:
        from refl_ddpo.testing.toy_build import build_toy_world

        return build_toy_world(out)
    from refl_ddpo.toy_world import files as toy_files

    return toy_files.write_toy_world(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", help="Folder to write (created if missing).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--denoiser_steps",
        type=int,
        default=0,
        help="Also write OUT/stable-diffusion-denoiser, trained this many steps (e.g. 800).",
    )
    parser.add_argument(
        "--toy_world",
        action="store_true",
        help="Also write the toy world: OUT/toy-sd/, OUT/toy-sd3/ and OUT/toy_classifier.{safetensors,json} "
        "(copied from the committed, checksummed weights).",
    )
    parser.add_argument(
        "--rebuild_toy_world",
        action="store_true",
        help="With --toy_world (implied): retrain the toy world from scratch instead of copying "
        "(slow, about 35 minutes on one core).",
    )
    args = parser.parse_args(argv)
    if args.denoiser_steps < 0:
        parser.error(f"--denoiser_steps {args.denoiser_steps}: give 0 (none) or a positive number of steps")
    out = write_tiny_models(args.out, args.seed, args.denoiser_steps)
    print(
        f"tiny random models written to {out} (random weights: outputs are noise, for tests and demos only)"
    )
    if args.toy_world or args.rebuild_toy_world:
        from refl_ddpo.core.errors import UserError
        from refl_ddpo.toy_world import world as toy_world

        try:
            sd = write_toy_world(out, rebuild=args.rebuild_toy_world)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(e.exit_code)
        print(
            f"toy world written: {sd}, {sd.parent / toy_world.SD3_DIRNAME} and "
            f"{out / 'toy_classifier.safetensors'}"
        )


if __name__ == "__main__":
    main()
