"""The hub, through huggingface_hub: hub ids, the repo of --push_to_hub (checked before anything loads, created
before training) and `download` (`snapshot_download`), for `inference_lora.py --lora_dir user/repo` and
`--resume_from_checkpoint user/repo` (`refl_ddpo.run.runs.hub_checkpoint`). What of a finished run is uploaded, and the
upload, are `refl_ddpo.run.hub_push`'s; this module imports nothing of a run.

HF_ENDPOINT points huggingface_hub at another server (the tests run a local stand-in of the hub's HTTP API).
"""

from __future__ import annotations

import re
from pathlib import Path

from refl_ddpo.core.errors import UserError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(name: str) -> bool:
    """'user/repo' that is not a local path: not on disk, and its first part is no local folder (so a default such
    as checkpoint/refl_lora that was not trained yet stays a missing folder, not a hub lookup)."""
    from refl_ddpo.core.models import looks_local

    return bool(HUB_ID.fullmatch(name)) and not looks_local(name) and not Path(name.split("/")[0]).is_dir()


def _hub_failures() -> tuple[type[Exception], ...]:
    """What a hub call raises when the hub says no or cannot be reached: HfHubHTTPError (an OSError) and the HTTP
    client's own errors (connection refused, timeouts), whose base huggingface_hub.errors imports as HTTPError."""
    from huggingface_hub import errors

    return (OSError, ValueError, getattr(errors, "HTTPError", OSError))


def _hub_error(what: str, e: Exception) -> UserError:
    first = " ".join(str(e).split())[:300] or type(e).__name__
    return UserError(f"{what} ({type(e).__name__}: {first})")


def repo_name(hub_model_id: str | None, output_dir: str) -> str:
    """--hub_model_id, default: the name of --output_dir."""
    return hub_model_id or Path(output_dir).resolve().name


def check_push(cfg) -> None:
    """Before anything loads (no network): --push_to_hub has a valid repo name, a token, and the hub is not off."""
    if not cfg.push_to_hub:
        return
    from huggingface_hub import constants, get_token
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    name = repo_name(cfg.hub_model_id, cfg.output_dir)
    try:
        validate_repo_id(name)
    except HFValidationError as e:
        raise UserError(
            f"--hub_model_id {name} is not a valid hub repo id ({str(e).splitlines()[0]})"
        ) from None
    if constants.HF_HUB_OFFLINE:
        raise UserError(
            "--push_to_hub needs the hub, but HF_HUB_OFFLINE is set: unset it (or drop --push_to_hub)."
        )
    if not (cfg.hub_token or get_token()):
        raise UserError(
            "--push_to_hub needs a hub token: pass --hub_token, set HF_TOKEN, or run `hf auth login` first."
        )


def create_hub_repo(name: str, token: str | None = None) -> str:
    """Create the repo `name` of --push_to_hub (`repo_name`) or find it, before training, so that a wrong token
    fails at once; returns its full id 'user/name'."""
    from huggingface_hub import HfApi

    try:
        return HfApi(token=token).create_repo(name, exist_ok=True).repo_id
    except _hub_failures() as e:  # network, auth, permission: one line with the hub's reason
        raise _hub_error(f"--push_to_hub: could not create the hub repo {name}", e) from None


def download(
    repo_id: str, flag: str, token: str | None = None, allow_patterns: list[str] | None = None
) -> Path:
    """A local copy of the hub repo `repo_id` (huggingface_hub's cache), or one line naming `flag` and the reason."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=allow_patterns, token=token))
    except _hub_failures() as e:  # not found, offline, auth: one line
        raise _hub_error(
            f"{flag} {repo_id}: not a local folder, and the hub repo of that id could not be fetched", e
        ) from None
