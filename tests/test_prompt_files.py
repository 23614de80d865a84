"""The prompt sources of flow_grpo's files: geneval_file (GenEval's metadata JSONL: each line the prompt's metadata)
and ocr_file (its OCR prompts: the quoted text as metadata ocr_text), through the epoch trainers' config and draw."""

import json

import pytest

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.prompts import epoch_prompt_fn, get_prompt_fn, load_geneval_jsonl, load_ocr_prompts

GENEVAL = [
    {
        "tag": "counting",
        "include": [{"class": "wine glass", "count": 2}],
        "exclude": [{"class": "wine glass", "count": 3}],
        "prompt": "a photo of two wine glasses",
    },
    {
        "tag": "position",
        "include": [
            {"class": "laptop", "count": 1},
            {"class": "cow", "count": 1, "position": ["right of", 0]},
        ],
        "prompt": "a photo of a cow right of a laptop",
    },
]
OCR = [
    'A neon sign that reads "Open 24 Hours" above a diner door.',
    'A chalkboard menu with "Soup of the Day" written in white chalk.',
]


@pytest.fixture
def files(tmp_path):
    geneval = tmp_path / "train_metadata.jsonl"
    geneval.write_text("".join(json.dumps(line) + "\n" for line in GENEVAL) + "\n")
    ocr = tmp_path / "train.txt"
    ocr.write_text("\n".join(OCR) + "\n")
    return geneval, ocr


def test_geneval_lines_reach_the_reward_as_metadata(files):
    geneval, _ = files
    pairs = load_geneval_jsonl(geneval)
    assert [p for p, _ in pairs] == [line["prompt"] for line in GENEVAL]
    assert [
        m for _, m in pairs
    ] == GENEVAL  # tag, include, exclude and the prompt, as GenEval's server reads them
    draws = [epoch_prompt_fn("geneval_file", str(geneval), seed=3)() for _ in range(1)]
    again = [epoch_prompt_fn("geneval_file", str(geneval), seed=3)() for _ in range(1)]
    assert draws == again and draws[0][1] == GENEVAL[[p for p, _ in pairs].index(draws[0][0])]


def test_ocr_prompts_carry_their_quoted_text(files):
    _, ocr = files
    assert [m["ocr_text"] for _, m in load_ocr_prompts(ocr)] == ["Open 24 Hours", "Soup of the Day"]
    prompt, metadata = epoch_prompt_fn("ocr_file", str(ocr), seed=0)()
    assert prompt in OCR and metadata["ocr_text"] in prompt


def test_from_file_draws_unchanged(files):
    _, ocr = files
    old = get_prompt_fn(str(ocr), seed=7)
    new = epoch_prompt_fn("from_file", str(ocr), seed=7)
    assert [old() for _ in range(6)] == [new() for _ in range(6)]
    assert epoch_prompt_fn("simple_animals", None, seed=1)() == get_prompt_fn("simple_animals", seed=1)()


def test_bad_files_are_one_line(tmp_path, files):
    bad = tmp_path / "bad.jsonl"
    for text, expected in (
        ('{"prompt": "a cat"}\nnot json\n', "line 2"),
        ('{"tag": "x"}\n', "'prompt' string"),
        ('{"prompt": "a cat", "include": [{"class": "cat"}]}\n', "'include' must be"),
    ):
        bad.write_text(text)
        with pytest.raises(UserError) as e:
            load_geneval_jsonl(bad)
        assert "\n" not in str(e.value) and expected in str(e.value)
    bad.write_text('a sign "Open"\na sign with no quoted text\n')
    with pytest.raises(UserError, match="no text in double quotes"):
        load_ocr_prompts(bad)


def test_the_epoch_trainers_take_them(files, tmp_path):
    from refl_ddpo.trainers.ddpo_config import parse_ddpo_config

    geneval, ocr = files
    base = ["--pretrained_model", str(tmp_path / "none")]
    cfg = parse_ddpo_config(["--prompt_fn", "geneval_file", "--prompts_file", str(geneval), *base])
    assert cfg.prompt_fn == "geneval_file" and cfg.prompts_file == str(geneval)
    parse_ddpo_config(["--prompt_fn", "ocr_file", "--prompts_file", str(ocr), *base])
    with pytest.raises(UserError, match="reads --prompts_file"):
        parse_ddpo_config(["--prompt_fn", "geneval_file", *base])
    with pytest.raises(UserError, match="both name the prompts"):
        parse_ddpo_config(["--prompt_fn", "simple_animals", "--prompts_file", str(ocr), *base])
