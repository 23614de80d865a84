"""docs/rewards.md lists every reward of the registry: a reward added to REWARDS without its row (contract, cost,
weights) fails here."""

from pathlib import Path

from refl_ddpo.rewards import REWARDS, URL_REWARDS

DOC = Path(__file__).resolve().parent.parent / "docs" / "rewards.md"


def documented_rewards() -> set[str]:
    """The names in the first cell of each row of the "Every reward" table (`name`, `name:URL`, `a` / `b:URL`)."""
    text = DOC.read_text().split("## Every reward", 1)[1]
    names = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            for cell in line.split("|")[1].split(" / "):
                names.add(cell.strip().strip("`").split("[")[0].split(":")[0])
    return names


def test_every_registered_reward_has_a_row():
    documented = documented_rewards()
    missing = sorted(set(REWARDS) - documented)
    assert not missing, f"docs/rewards.md's 'Every reward' table lacks {missing}: add a row for each"
    assert set(URL_REWARDS) <= documented and "hpsv3" in documented
