"""The toy world's models and their training, deterministic from seeds: the VAE, the text encoders, the UNet, the
classifier and the SD3 MMDiT (what each is: refl_ddpo.testing.toy_build, which builds the world from them)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from refl_ddpo.testing.tiny_parts import SD_SCHEDULER_CONFIG, clip_tokenizer, tiny_clip_config
from refl_ddpo.toy_world import world as tw

SEED = 0
VAE_STEPS, VAE_BATCH, VAE_LR = 800, 32, 2e-3
UNET_STEPS, UNET_BATCH, UNET_LR = 900, 32, 1e-3
CLASSIFIER_STEPS, CLASSIFIER_BATCH, CLASSIFIER_LR = 1200, 64, 3e-3
CLASSIFIER_CHANNELS = (16, 24, 32, 32)
EMPTY_PROMPT_P = 0.15
# The deliberate imperfection: in the UNet's training captions each colour word stands, half of the time, for its
# partner colour (the image is drawn in the partner colour), so the base model draws "a red circle" red or magenta
# about equally (colour accuracy ~50 %, at any guidance scale) while its shapes stay clean. Rewards must teach it
# the difference; held-out combos share the colour words with the training ones.
CONFUSABLE = {
    "red": "magenta",
    "magenta": "red",
    "green": "yellow",
    "yellow": "green",
    "blue": "cyan",
    "cyan": "blue",
}
CONFUSE_P = 0.5
TEXT_HIDDEN = 64
# SD3: an MMDiT trained by flow matching on the same VAE latents, captions and confusion
SD3_STEPS, SD3_BATCH, SD3_LR = 1200, 16, 1e-3
SD3_LAYERS = 3
SD3_TEXT_HIDDEN = 32
SD3_SHIFT = 3.0


def deterministic() -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)


def to_unit(images_u8: torch.Tensor) -> torch.Tensor:
    return images_u8.float() / 255


def make_vae(seed: int = SEED):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(16, 32),
        layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        sample_size=tw.SIZE,
        norm_num_groups=8,
    )


def train_vae(vae, steps: int = VAE_STEPS, seed: int = SEED, batch: int = VAE_BATCH, lr: float = VAE_LR):
    """Autoencoder training on rendered images in [-1, 1] (posterior samples, MSE + 1e-6 KL, cosine lr); then
    sets `scaling_factor` to 1 / std of the posterior samples of 1024 fresh images."""
    from tqdm.auto import tqdm

    g = torch.Generator().manual_seed(seed + 100)
    vae.train().requires_grad_(True)
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + math.cos(math.pi * i / steps)))
    for _ in tqdm(range(steps), desc="toy VAE", leave=False):
        x = to_unit(tw.random_batch(batch, g)[0]) * 2 - 1
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample(generator=g)).sample
        loss = F.mse_loss(rec, x) + 1e-6 * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        x = to_unit(tw.random_batch(1024, g)[0]) * 2 - 1
        z = torch.cat([vae.encode(c).latent_dist.sample(generator=g) for c in x.split(128)])
    vae.register_to_config(scaling_factor=float(1.0 / z.std()))
    return vae


@torch.no_grad()
def vae_round_trip(vae, images_unit: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Images in [0, 1] -> encode (posterior sample if a generator is given, else its mode) -> decode -> [0, 1]."""
    dist = vae.encode(images_unit * 2 - 1).latent_dist
    z = dist.sample(generator=generator) if generator is not None else dist.mode()
    return (vae.decode(z).sample / 2 + 0.5).clamp(0, 1)


def make_text(seed: int = SEED, with_projection: bool = False, hidden: int = TEXT_HIDDEN):
    """(tokenizer, text encoder): the tiny char-level CLIP tokenizer of refl_ddpo.testing.tiny_parts and a random, frozen CLIP
    text model `hidden` wide (SD 1.x's CLIPTextModel; `with_projection`: SD3's CLIPTextModelWithProjection, its
    pooled projection as wide as its hidden states)."""
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    tokenizer = clip_tokenizer()
    torch.manual_seed(seed + 2)
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    # SD 1.x's config keeps CLIPTextConfig's default projection_dim (as committed)
    projection = {"projection_dim": hidden} if with_projection else {}
    text_encoder = cls(tiny_clip_config(tokenizer, hidden, **projection))
    return tokenizer, text_encoder.eval().requires_grad_(False)


def make_unet(seed: int = SEED):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed + 1)
    return UNet2DConditionModel(
        sample_size=tw.SIZE // 2,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=TEXT_HIDDEN,
        attention_head_dim=8,
        norm_num_groups=32,
    )


def make_pipeline(vae, tokenizer, text_encoder, unet):
    from diffusers import PNDMScheduler, StableDiffusionPipeline

    return StableDiffusionPipeline(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=PNDMScheduler.from_config(SD_SCHEDULER_CONFIG),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _captions(prompts: list[str], g: torch.Generator, confuse_p: float = CONFUSE_P) -> torch.Tensor:
    """Indices into PROMPTS + [""] of the training captions of images drawing `prompts`: each colour word replaced by
    its CONFUSABLE partner with probability `confuse_p`, then the caption by "" with probability EMPTY_PROMPT_P."""
    index = {p: i for i, p in enumerate(tw.PROMPTS)}
    swap = (torch.rand(len(prompts), generator=g) < confuse_p).tolist()
    captions = []
    for p, sw in zip(prompts, swap, strict=True):
        colour, shape = tw.parse_prompt(p)
        captions.append(f"a {CONFUSABLE[colour]} {shape}" if sw else p)
    idx = torch.tensor([index[p] for p in captions])
    return torch.where(torch.rand(len(prompts), generator=g) < EMPTY_PROMPT_P, len(tw.PROMPTS), idx)


def _fit(network, steps: int, lr: float, desc: str, loss_fn, callback=None) -> None:
    """AdamW on all of `network` for `steps` steps of `loss_fn()`; lr: 50 warm-up steps, then cosine decay to 10 %.
    `callback(step, network)` after each step."""
    from tqdm.auto import tqdm

    network.train().requires_grad_(True)
    opt = torch.optim.AdamW(network.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min((i + 1) / 50, 0.55 + 0.45 * math.cos(math.pi * min(i, steps) / steps))
    )
    for step in tqdm(range(steps), desc=desc, leave=False):
        loss = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if callback is not None:
            callback(step + 1, network)
    network.eval().requires_grad_(False)


def _world_latents(
    vae, batch: int, g: torch.Generator, confuse_p: float = CONFUSE_P
) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents x0 of `batch` rendered images: posterior samples, (z - shift_factor) * scaling_factor; their
    training caption indices, see `_captions`)."""
    images, prompts = tw.random_batch(batch, g)
    with torch.no_grad():
        z = vae.encode(to_unit(images) * 2 - 1).latent_dist.sample(generator=g)
    x0 = (z - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor
    return x0, _captions(prompts, g, confuse_p)


def train_unet(
    pipe,
    steps: int = UNET_STEPS,
    seed: int = SEED,
    batch: int = UNET_BATCH,
    lr: float = UNET_LR,
    callback=None,
    confuse_p: float = CONFUSE_P,
) -> None:
    """Epsilon-prediction training of `pipe.unet` on VAE latents of rendered images of all 18 prompts, with the
    captions of `_captions` (colour words confused with probability `confuse_p`, empty prompts); lr as `_fit`.
    `callback(step, unet)` after each step."""
    from diffusers import DDPMScheduler

    noise_scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
    g = torch.Generator().manual_seed(seed + 200)
    with torch.no_grad():
        conds = pipe.encode_prompt(list(tw.PROMPTS) + [""], "cpu", 1, False)[0]  # (19, 77, D)

    def loss_fn():
        x0, idx = _world_latents(pipe.vae, batch, g, confuse_p)
        noise = torch.randn(x0.shape, generator=g)
        t = torch.randint(0, noise_scheduler.config.num_train_timesteps, (batch,), generator=g)
        noisy = noise_scheduler.add_noise(x0, noise, t)
        pred = pipe.unet(noisy, t, encoder_hidden_states=conds[idx], return_dict=False)[0]
        return F.mse_loss(pred, noise)

    _fit(pipe.unet, steps, lr, "toy UNet", loss_fn, callback)


# ---- SD3: an MMDiT on the same world, by flow matching ----


def make_transformer(seed: int = SEED):
    """SD3Transformer2DModel on the toy VAE's 16 x 16 x 4 latents: patch 2 (8 x 8 tokens), SD3_LAYERS joint blocks
    64 wide (4 heads of 16), the two CLIPs' hidden states side by side as its context (2 x SD3_TEXT_HIDDEN)."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed + 5)
    return SD3Transformer2DModel(
        sample_size=tw.SIZE // 2,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=SD3_LAYERS,
        attention_head_dim=16,
        num_attention_heads=4,
        caption_projection_dim=64,  # = num_attention_heads * attention_head_dim
        joint_attention_dim=2 * SD3_TEXT_HIDDEN,
        pooled_projection_dim=2 * SD3_TEXT_HIDDEN,
        pos_embed_max_size=tw.SIZE // 2,
    )


def sd3_vae(sd_dir: Path):
    """The toy SD 1.x VAE (from `sd_dir`/vae) as SD3's pipeline reads it: 4 latent channels, shift_factor 0."""
    from safetensors.torch import load_file

    vae = make_vae()
    config = json.loads((Path(sd_dir) / "vae" / "config.json").read_text())
    vae.load_state_dict(load_file(str(Path(sd_dir) / "vae" / "diffusion_pytorch_model.safetensors")))
    vae.register_to_config(scaling_factor=config["scaling_factor"], shift_factor=0.0)
    return vae.eval().requires_grad_(False)


def make_sd3_pipeline(vae, seed: int = SEED):
    """StableDiffusion3Pipeline: `vae`, a fresh MMDiT (`make_transformer`), two random frozen CLIPs with projection
    (SD3_TEXT_HIDDEN wide, seeds apart), no T5, FlowMatchEulerDiscreteScheduler with shift SD3_SHIFT."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    tokenizer, text_encoder = make_text(seed + 10, with_projection=True, hidden=SD3_TEXT_HIDDEN)
    tokenizer_2, text_encoder_2 = make_text(seed + 11, with_projection=True, hidden=SD3_TEXT_HIDDEN)
    return StableDiffusion3Pipeline(
        transformer=make_transformer(seed),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=None,
        tokenizer_3=None,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SD3_SHIFT),
    )


def train_transformer(
    pipe,
    steps: int = SD3_STEPS,
    seed: int = SEED,
    batch: int = SD3_BATCH,
    lr: float = SD3_LR,
    callback=None,
    confuse_p: float = CONFUSE_P,
) -> None:
    """Flow-matching training of `pipe.transformer` as SD3's (diffusers' train_dreambooth_sd3, logit-normal
    weighting): u ~ sigmoid(N(0, 1)), sigma = the scheduler's shift of u (shift u / (1 + (shift - 1) u)),
    x_sigma = (1 - sigma) x0 + sigma z, target velocity z - x0, timestep 1000 sigma; latents and captions as the
    UNet's (`_world_latents`); lr as `_fit`."""
    g = torch.Generator().manual_seed(seed + 500)
    shift = pipe.scheduler.config.shift
    n_train = pipe.scheduler.config.num_train_timesteps
    with torch.no_grad():  # the pipeline's own encoding (both CLIPs, zero T5 tokens), the empty prompt last
        embeds, _, pooled, _ = pipe.encode_prompt(list(tw.PROMPTS) + [""], None, None, device="cpu")

    def loss_fn():
        x0, idx = _world_latents(pipe.vae, batch, g, confuse_p)
        noise = torch.randn(x0.shape, generator=g)
        u = torch.sigmoid(torch.randn(batch, generator=g))
        sigma = shift * u / (1 + (shift - 1) * u)
        s = sigma.view(-1, 1, 1, 1)
        v = pipe.transformer(
            hidden_states=(1 - s) * x0 + s * noise,
            timestep=sigma * n_train,
            encoder_hidden_states=embeds[idx],
            pooled_projections=pooled[idx],
            return_dict=False,
        )[0]
        return F.mse_loss(v, noise - x0)

    _fit(pipe.transformer, steps, lr, "toy MMDiT", loss_fn, callback)


def _blur(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Per-image 3x3 Gaussian blur (sigma [B], 0 = none)."""
    d = torch.tensor([-1.0, 0.0, 1.0])
    w1 = torch.exp(-(d.view(1, 3) ** 2) / (2 * sigma.clamp(min=1e-3).view(-1, 1) ** 2))
    w1 = w1 / w1.sum(dim=1, keepdim=True)  # (B, 3)
    k = (w1[:, :, None] * w1[:, None, :]).repeat_interleave(3, dim=0).unsqueeze(1)  # (B*3, 1, 3, 3)
    b, c, h, w = x.shape
    y = F.conv2d(F.pad(x.reshape(1, b * c, h, w), (1, 1, 1, 1), mode="replicate"), k, groups=b * c)
    return y.view(b, c, h, w)


def augment(images_unit: torch.Tensor, g: torch.Generator, vae=None) -> torch.Tensor:
    """Classifier augmentation: VAE round trip (half of the images, when a VAE is given), blur (sigma 0..1), a
    per-image brightness/contrast jitter, Gaussian noise (std 0..0.08)."""
    x = images_unit
    b = len(x)
    if vae is not None:
        pick = torch.rand(b, generator=g) < 0.5
        if pick.any():
            x = x.clone()
            x[pick] = vae_round_trip(vae, x[pick], g)
    x = _blur(x, torch.rand(b, generator=g))
    scale = 1 + 0.1 * (torch.rand(b, 1, 1, 1, generator=g) * 2 - 1)
    shift = 0.05 * (torch.rand(b, 1, 1, 1, generator=g) * 2 - 1)
    x = (x - 0.5) * scale + 0.5 + shift
    x = x + torch.randn(x.shape, generator=g) * 0.08 * torch.rand(b, 1, 1, 1, generator=g)
    return x.clamp(0, 1)


def train_classifier(
    vae=None,
    steps: int = CLASSIFIER_STEPS,
    seed: int = SEED,
    batch: int = CLASSIFIER_BATCH,
    lr: float = CLASSIFIER_LR,
) -> tw.ToyClassifier:
    from tqdm.auto import tqdm

    torch.manual_seed(seed + 3)
    model = tw.ToyClassifier(CLASSIFIER_CHANNELS)
    g = torch.Generator().manual_seed(seed + 300)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + math.cos(math.pi * i / steps)))
    model.train()
    for _ in tqdm(range(steps), desc="toy classifier", leave=False):
        images, prompts = tw.random_batch(batch, g)
        c, s = tw.prompt_indices(prompts)
        logits_c, logits_s = model(augment(to_unit(images), g, vae))
        loss = F.cross_entropy(logits_c, c) + F.cross_entropy(logits_s, s)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return model.eval().requires_grad_(False)


@torch.no_grad()
def classifier_accuracy(model, images_unit: torch.Tensor, prompts: list[str]) -> tuple[float, float]:
    c, s = tw.prompt_indices(prompts)
    lc, ls = model(images_unit)
    return (lc.argmax(1) == c).float().mean().item(), (ls.argmax(1) == s).float().mean().item()
