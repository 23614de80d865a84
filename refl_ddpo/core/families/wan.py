"""Wan 2.1 and Wan 2.2 text-to-video: a `WanTransformer3DModel` predicting the flow-matching velocity on 5-D video
latents (B, 16, T, h, w), a UMT5 text encoder, `AutoencoderKLWan` (a causal 3-D VAE: 4x in time, 8x in space)
whose latents are stored as (z - latents_mean) / latents_std per channel, and a flow-matching sampler.

Everything the stock `WanPipeline.__call__` does for text-to-video is kept, so the same seed gives the same video:
its `encode_prompt` (each prompt cleaned as `prompt_clean` does, tokenized to `max_sequence_length` 512, the UMT5's
last hidden state cut at the prompt's own tokens and right-padded with zeros to 512), its noise (float32,
(B, 16, (num_frames - 1) / 4 + 1, H / 8, W / 8)), its CFG against the empty prompt (two network calls,
uncond + s (text - uncond), on when guidance_scale > 1), its step and its decode (latents / (1 / latents_std) +
latents_mean, then the VAE). The frames come out as (B, T, 3, H, W) in [0, 1]: the reward contract's video.

Wan 2.2 (A14B) has two experts: `transformer` denoises the steps with timestep >= boundary_ratio * 1000 (high noise),
`transformer_2` the others, each with its guidance scale (`guidance_scale_2`, default the first's). `train_expert`
chooses what the trainers adapt: one expert ("transformer", default, or "transformer_2"; the other runs frozen at
its steps, whose loss terms then have a zero gradient, linked to the trained network by 0 x one of its weights, so
that every training step has a graph), or "both", a LoRA on each, every step's loss reaching the expert that ran
it. The trained network is the pair as one module (`wan_experts.WanExperts`, the LoRA on the trained expert(s)), so
that every expert call, the frozen one's too, goes through whatever wraps it (DDP); only a run whose network is
sharded or run by DeepSpeed, or trained whole, trains the one expert itself (`train_expert`'s `pair`). A LoRA
of `transformer_2` loads into the stock pipeline with `load_lora_weights(..., load_into_transformer_2=True)`.
Wan 2.2 TI2V-5B (`expand_timesteps`) takes one timestep per video token, as its pipeline builds them.

Sampler. The real folders carry a `UniPCMultistepScheduler` with `flow_shift`; the kit samples with the
flow-matching Euler sampler (its log-prob step is Flow-GRPO's), built with `shift` = that `flow_shift`. The flow maths
(Euler step, SDE step, x0, forward process, KLs) are SD3's, on 5-D tensors.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families.base import Cond
from refl_ddpo.core.families.sd3 import StableDiffusion3
from refl_ddpo.core.steps.flow_sde import step_sigmas

DEFAULT_NUM_FRAMES = 81  # WanPipeline.__call__'s num_frames
EXPERTS = ("transformer", "transformer_2")
BOTH = "both"  # --wan_expert both: a LoRA on each expert (wan_experts.WanExperts)


class Wan(StableDiffusion3):
    name = "wan"
    pipeline_class = "WanPipeline"
    network_name = "transformer"
    # self- and cross-attention projections and the MLP of every block
    lora_target_modules: ClassVar[list[str]] = [
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "ffn.net.0.proj",
        "ffn.net.2",
    ]
    max_sequence_length = 512  # WanPipeline.__call__'s default (every prompt is padded to it)

    def __init__(self, pipe):
        super().__init__(pipe)
        self.num_frames = DEFAULT_NUM_FRAMES
        self.guidance_scale_2: float | None = None  # Wan 2.2's low-noise expert; None: guidance_scale
        self.experts = None  # --wan_expert both: the pair the trainers adapt (train_expert), else None
        if type(pipe.scheduler).__name__ != "FlowMatchEulerDiscreteScheduler":
            pipe.scheduler = self.scheduler("FlowMatchEulerDiscreteScheduler")

    def train_expert(self, expert: str, pair: bool = True) -> None:
        """Make `expert` ("transformer", "transformer_2", or "both") the expert(s) the trainers adapt. On a model
        with two experts the network (`network`) is the pair, the LoRA on `expert` only; `pair` False (one expert
        trained sharded, by DeepSpeed or whole): that expert itself."""
        have = [e for e in EXPERTS if getattr(self.pipe, e, None) is not None]
        if expert not in (*EXPERTS, BOTH) or not set(EXPERTS if expert == BOTH else [expert]) <= set(have):
            raise UserError(f"--wan_expert {expert}: this Wan model has {', '.join(have)}.")
        if len(have) == 2 and (pair or expert == BOTH):
            from refl_ddpo.core.families.wan_experts import WanExperts

            trained = EXPERTS if expert == BOTH else (expert,)
            self.experts = WanExperts(self.pipe.transformer, self.pipe.transformer_2, trained)
        else:
            self.experts = None
        # both: the high-noise expert, whose config the pair shows
        self.network_name = "transformer" if expert == BOTH else expert

    @property
    def network(self) -> torch.nn.Module:
        """The trained network: the pair on a model with two experts (`train_expert`), else the expert."""
        return self.experts if self.experts is not None else getattr(self.pipe, self.network_name)

    def scheduler(self, kind: str):
        """As the base class; the flow-matching Euler sampler from a UniPC config takes its `flow_shift` as shift."""
        config = dict(self.pipe.scheduler.config)
        if kind == "FlowMatchEulerDiscreteScheduler" and "flow_shift" in config:
            from diffusers import FlowMatchEulerDiscreteScheduler

            return FlowMatchEulerDiscreteScheduler(
                num_train_timesteps=config.get("num_train_timesteps", 1000), shift=config["flow_shift"]
            )
        return super().scheduler(kind)

    @property
    def vae_scale_factor(self) -> int:
        return self.pipe.vae_scale_factor_spatial

    @property
    def native_resolution(self) -> int:
        """480: the height of WanPipeline's default 480 x 832 (the kit's videos are square)."""
        return 480

    def prompt_reader(self):
        return self.pipe.tokenizer, self.max_sequence_length

    def run_text_encoders(self, prompts: list[str], with_negative: bool) -> tuple[Cond, Cond | None]:
        """The pipeline's own `encode_prompt`; the negative is the empty prompt (its default), None unless
        `with_negative`."""
        embeds, negative = self.pipe.encode_prompt(
            prompt=list(prompts),
            do_classifier_free_guidance=with_negative,
            max_sequence_length=self.max_sequence_length,
            device=self.pipe.device,
        )
        return {"prompt_embeds": embeds}, ({"prompt_embeds": negative} if with_negative else None)

    def initial_noise(self, batch_size: int, resolution: int, generator, dtype: torch.dtype) -> torch.Tensor:
        """N(0, 1) latents (B, 16, T, h, w) in float32 whatever `dtype`, as `prepare_latents` draws them, for
        `num_frames` frames: T = (num_frames - 1) / 4 + 1."""
        from diffusers.utils.torch_utils import randn_tensor

        f = self.vae_scale_factor * self.network.config.patch_size[1]
        if resolution % f:
            raise ValueError(
                f"resolution {resolution} is not a multiple of {f} (VAE scale factor x patch size)"
            )
        frames = (self.num_frames - 1) // self.pipe.vae_scale_factor_temporal + 1
        side = resolution // self.vae_scale_factor
        shape = (batch_size, self.vae.config.z_dim, frames, side, side)  # I2V's network reads more
        return randn_tensor(shape, generator=generator, device=self.pipe.device, dtype=torch.float32)

    def set_timesteps(self, scheduler, num_inference_steps: int, latents: torch.Tensor) -> torch.Tensor:
        """As the pipeline: `set_timesteps(num_inference_steps)`, no shift by the video's size."""
        scheduler.set_timesteps(num_inference_steps, device="cpu")  # on the host: see the base class
        return scheduler.timesteps

    def boundary(self, scheduler) -> float | None:
        """Wan 2.2's switch timestep boundary_ratio * num_train_timesteps (None: one expert)."""
        ratio = self.pipe.config.get("boundary_ratio")
        return None if ratio is None else ratio * scheduler.config.num_train_timesteps

    def predict(
        self,
        latents,
        timesteps,
        scheduler,
        cond: Cond,
        uncond: Cond | None,
        guidance_scale: float,
        network=None,
    ) -> torch.Tensor:
        """Velocity (B, 16, T, h, w) in the network's dtype. Each sample's expert by its timestep (Wan 2.2: the
        high-noise `transformer` at t >= boundary, else `transformer_2` with `guidance_scale_2`); `network` stands in
        for the trained network (the pair: called with the expert's name, each expert through it). CFG as the
        pipeline: two calls, uncond + s (text - uncond), when guidance_scale > 1 and `uncond` is given. `timesteps`
        is a scalar or one per sample (B,)."""
        t = timesteps.expand(latents.shape[0]) if timesteps.ndim == 0 else timesteps
        boundary = self.boundary(scheduler)
        if boundary is None:
            return self._expert_call("transformer", network, latents, t, cond, uncond, guidance_scale)
        high = t >= boundary
        n_high = int(high.sum())
        if n_high in (0, len(t)):  # one expert for the whole batch (always so while sampling)
            expert, scale = self._expert(bool(n_high), guidance_scale)
            return self._expert_call(expert, network, latents, t, cond, uncond, scale)
        parts, idxs = [], []
        for mask in (
            high,
            ~high,
        ):  # both experts' calls in one forward of the pair (DDP: one forward per backward)
            idx = mask.nonzero().squeeze(1)
            expert, scale = self._expert(mask is high, guidance_scale)
            parts.append((expert, latents[idx], t[idx], _rows(cond, idx), _rows(uncond, idx), scale))
            idxs.append(idx)
        out = None
        for idx, part in zip(idxs, self._expert_calls(network, parts), strict=True):
            out = part.new_zeros(latents.shape) if out is None else out
            out = out.index_copy(0, idx, part)
        return out

    def _expert(self, high: bool, guidance_scale: float) -> tuple[str, float]:
        if high:
            return "transformer", guidance_scale
        return "transformer_2", (guidance_scale if self.guidance_scale_2 is None else self.guidance_scale_2)

    def _expert_call(self, expert, network, latents, t, cond, uncond, guidance_scale):
        """One expert's (guided) velocity, as the pipeline's loop body calls it."""
        return self._expert_calls(network, [(expert, latents, t, cond, uncond, guidance_scale)])[0]

    def _expert_calls(self, network, parts: list[tuple]) -> list[torch.Tensor]:
        """The guided velocity of each part (expert, latents, t, cond, uncond, guidance_scale). Through the trained
        pair (`network` a `WanExperts`, wrapped or not), every call of the parts is one forward of it: DDP meets one
        forward before each backward, whichever experts the rows need (a frozen expert's zero link is made in
        there: `WanExperts.forward`)."""
        calls, guided = [], []
        for expert, latents, t, cond, uncond, scale in parts:
            x, tt, extra = self.network_inputs(getattr(self.pipe, expert), latents, t, cond)
            kw = {"hidden_states": x, "timestep": tt, "return_dict": False, **extra}
            calls.append((expert, {"encoder_hidden_states": cond["prompt_embeds"], **kw}))
            guided.append(scale > 1.0 and uncond is not None)
            if guided[-1]:
                calls.append((expert, {"encoder_hidden_states": uncond["prompt_embeds"], **kw}))
        if network is not None and self.experts is not None:
            outs = iter(network(calls))
        else:
            outs = iter([self._unpaired(expert, network)(**kw)[0] for expert, kw in calls])
        velocities = []
        for (expert, *_, scale), cfg in zip(parts, guided, strict=True):
            v = next(outs)
            if cfg:
                v_uncond = next(outs)
                v = v_uncond + scale * (v - v_uncond)
            if (
                self.experts is None
                and network is not None
                and expert != self.network_name
                and torch.is_grad_enabled()
            ):
                # the frozen expert's steps, the expert trained itself: a loss with a (zero) gradient, as the others
                v = v + _zero_from(network)
            velocities.append(v)
        return velocities

    def _unpaired(self, expert: str, network):
        """The module that runs `expert` without the pair: `network` where it is the trained expert, else the
        pipeline's own."""
        return network if network is not None and expert == self.network_name else getattr(self.pipe, expert)

    def network_inputs(self, net, latents, t, cond: Cond) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(hidden_states, timestep, other keyword arguments) of an expert's call on `latents` at `t` (B,): the
        latents in the conditioning's dtype; TI2V-5B (`expand_timesteps`) one timestep per video token. The
        image-to-video family (families/wan_i2v.py) adds its image condition here."""
        x = latents.to(cond["prompt_embeds"].dtype)
        if self.pipe.config.get("expand_timesteps", False):  # TI2V-5B: one timestep per video token
            p = net.config.patch_size
            tokens = x.shape[2] // p[0] * (x.shape[3] // p[1]) * (x.shape[4] // p[2])
            t = t[:, None].expand(-1, tokens)
        return x, t, {}

    def add_noise(self, scheduler, x0: torch.Tensor, noise: torch.Tensor, timestep) -> torch.Tensor:
        """The flow-matching forward process at `timestep`'s sigma: (1 - sigma) x0 + sigma noise (5-D)."""
        sigma = step_sigmas(scheduler, timestep, x0.shape[0])[0].to(x0.device).view(-1, 1, 1, 1, 1)
        return ((1 - sigma) * x0.float() + sigma * noise.float()).to(x0.dtype)

    def decode(self, latents: torch.Tensor, frames: int | None = None) -> torch.Tensor:
        """Latents -> frames (B, T, 3, H, W) in [0, 1], with the pipeline's de-normalisation. `frames`: the first
        `frames` only, decoded from the latent frames they need alone (the VAE is causal in time: its first
        1 + s (k - 1) frames, s its temporal stride, depend on the first k latent frames only)."""
        vae = self.vae
        latents = latents.to(vae.dtype)
        if frames is not None:  # ceil((frames - 1) / s) + 1 latent frames
            s = self.pipe.vae_scale_factor_temporal
            latents = latents[:, :, : (frames + s - 2) // s + 1]
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]  # (B, 3, T, H, W) in [-1, 1]
        video = (video.float() / 2 + 0.5).clamp(0, 1).transpose(1, 2)
        return video if frames is None else video[:, :frames]


def _zero_from(network) -> torch.Tensor:
    """0 from the first trainable tensor of `network` (0 x its first value): adds nothing, links the graph."""
    p = next((p for p in network.parameters() if p.requires_grad), None)
    return torch.zeros(()) if p is None else 0.0 * p.reshape(-1)[0]


def _rows(cond: Cond | None, idx: torch.Tensor) -> Cond | None:
    return None if cond is None else {k: v[idx] for k, v in cond.items()}
