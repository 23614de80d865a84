"""A finished run to the hub (--push_to_hub): `push_run` uploads, in one commit, what a user of the weights needs and
what a resumed run needs, nothing else of the output folder (`push_patterns`):

    pytorch_lora_weights.safetensors (or unet/)   the final weights
    config.json, README.md                        the resolved training config, the model card
    validation/{step|epoch}-N.png                 the last validation grid (the card shows it)
    checkpoint-N/                                 the newest complete checkpoint, so that the run can be continued

`--resume_from_checkpoint user/repo` fetches that checkpoint back (`refl_ddpo.run.runs.hub_checkpoint`).
"""

from __future__ import annotations

from pathlib import Path

from refl_ddpo.run.hub import _hub_error, _hub_failures


def push_patterns(out_dir: Path, run_id: str | None = None) -> list[str]:
    """What of a finished output folder goes to the hub (see the module doc); the checkpoint of run `run_id`."""
    from refl_ddpo.core.lora import CONFIG_NAME, EXPERT_2_DIR, FULL_UNET_DIR, LORA_WEIGHTS_NAME
    from refl_ddpo.run.model_card import CARD_NAME
    from refl_ddpo.run.runs import list_checkpoints
    from refl_ddpo.run.validation import VALIDATION_DIR, validation_files

    patterns = [LORA_WEIGHTS_NAME, f"{FULL_UNET_DIR}/*", f"{EXPERT_2_DIR}/*", CONFIG_NAME, CARD_NAME]
    records = validation_files(out_dir)
    if records:
        patterns.append(f"{VALIDATION_DIR}/{records[-1]['grid']}")
    complete = list_checkpoints(out_dir, run_id)
    if complete:
        patterns.append(f"{complete[-1].name}/*")
    return patterns


def push_run(
    repo_id: str, out_dir: str | Path, message: str, run_id: str | None = None, token: str | None = None
) -> str:
    """Upload the finished run in `out_dir` to `repo_id` (one commit, with `token`), with the newest checkpoint of
    run `run_id`; returns the commit's URL."""
    from huggingface_hub import HfApi

    try:
        info = HfApi(token=token).upload_folder(
            repo_id=repo_id,
            folder_path=str(out_dir),
            allow_patterns=push_patterns(Path(out_dir), run_id),
            commit_message=message,
        )
    except (
        _hub_failures()
    ) as e:  # network, auth, quota: one line; the local output folder is complete regardless
        raise _hub_error(
            f"--push_to_hub: uploading {out_dir} to {repo_id} failed, the local folder is complete; upload it "
            "later with `hf upload`",
            e,
        ) from None
    return str(getattr(info, "commit_url", info))
