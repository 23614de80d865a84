"""The command line of the reward-backprop trainer (ReFL, DRaFT-K / LV, AlignProp): refl_ddpo.trainers.reward_backprop,
whose module doc is the --help text.

    python -m refl_ddpo.trainers.refl [--flag value ...]      (usually via train_scripts/train_refl_lora.sh)
"""

from refl_ddpo.core.errors import cli_main
from refl_ddpo.run.session import main_for
from refl_ddpo.trainers import reward_backprop
from refl_ddpo.trainers.refl_config import ReFLConfig
from refl_ddpo.trainers.reward_backprop import build_refl_reward, preflight, train

__all__ = ["ReFLConfig", "build_refl_reward", "main", "preflight", "train"]


@cli_main
def main(argv: list[str] | None = None) -> None:
    main_for(train, preflight, ReFLConfig, argv, reward_backprop.__doc__)


if __name__ == "__main__":
    main()
