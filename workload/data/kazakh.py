"""A seeded generator of 256 Kazakh instruction/response rows in Soup's alpaca format.

The challenge fine-tunes on a Kazakh instruction dataset that is not public; this stands in for
it. Rows are {"instruction", "input", "output"} (``input`` is "" unless the task has a text to
work on). Answers are assembled from hand-written Kazakh sentences (phrases*.py); their sentence
count is drawn from a log-normal law, so lengths after Qwen's chat template have a realistic shape:
median ~200 tokens, a long tail, and a few percent over the 512-token limit (they get truncated).

    python -m workload.data.kazakh --out workload/data/kazakh_instructions.jsonl   # regenerate
    python -m workload.data.kazakh --stats                                         # token lengths
    python -m workload.data.kazakh --shape long|short --out FILE [--stats]         # a shape variant

Shape variants (for bench.compare --shapes): the same seeded stream of rows, kept only where the
row's length after the chat template (the project's offline Qwen tokenizer) fits the shape:
``long``, every row over max_length 512 tokens (every batch is 4 x 512 after truncation, no
padding); ``short``, every row under 112 tokens. ``shipped`` is the committed file's rows.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import random
from pathlib import Path

from .phrases import (ADVICE_CLOSERS, CLOSERS, CONNECTORS, GENERIC_TEMPLATES, HEADINGS, INTROS,
                      LINKED_STARTS, PLAIN_INTROS, PROPER_PREFIXES, RELATED_INTRO, TOPICS)
from .phrases_facts import FACT_TOPICS
from .phrases_kz import KZ_TOPICS
from .phrases_lists import (LIST_INTROS, LISTS, TRANSLATE_INSTRUCTIONS, TRANSLATION_PREFIXES,
                            TRANSLATIONS)

SEED = 20240915
N_ROWS = 256
MAX_LENGTH = 512  # the workload's data.max_length
DEFAULT_PATH = Path(__file__).with_name("kazakh_instructions.jsonl")

# Sentence count of an answer: 1 + floor(lognormal(MU, SIGMA)).
MU, SIGMA = 0.9, 0.9

SUBJECT_TOPICS = {**FACT_TOPICS, **KZ_TOPICS}  # subject -> its own sentences
# Row kinds and their weights.
KINDS = (("generic", 30), ("subject", 34), ("list", 10), ("translate", 12), ("summary", 7),
         ("keypoints", 7))

SUMMARY_INSTRUCTIONS = ["Мына мәтіннің негізгі ойын бір-екі сөйлеммен жеткізіңіз.",
                        "Келесі мәтінді қысқаша мазмұндаңыз."]
KEYPOINT_INSTRUCTIONS = ["Мына мәтіндегі негізгі ойларды тізім түрінде жазыңыз.",
                         "Мәтіндегі ең маңызды ойларды бөліп көрсетіңіз."]


def capitalize(text: str) -> str:
    """Upper-case the first letter (after an opening «, if any)."""
    i = 1 if text.startswith("«") else 0
    return text[:i] + text[i:i + 1].upper() + text[i + 1:]


def decapitalize(sentence: str) -> str:
    """Lower-case the first letter, unless the sentence starts with a proper noun or acronym."""
    if sentence.startswith(PROPER_PREFIXES) or (len(sentence) > 1 and sentence[1].isupper()):
        return sentence
    return sentence[:1].lower() + sentence[1:]


def sentence_count(rng: random.Random) -> int:
    return 1 + int(math.exp(rng.gauss(MU, SIGMA)))


def paragraph(rng: random.Random, sentences: list[str]) -> str:
    """Join sentences, putting a connector before about a quarter of them (never the first one,
    never two sentences in a row)."""
    out, last_joined = [], False
    for i, sentence in enumerate(sentences):
        if i > 0 and not last_joined and not sentence.startswith(LINKED_STARTS) and rng.random() < 0.25:
            sentence = rng.choice(CONNECTORS) + decapitalize(sentence)
            last_joined = True
        else:
            last_joined = False
        out.append(sentence)
    return " ".join(out)


def numbered(sentences: list[str]) -> str:
    return "\n".join(f"{i}. {s}" for i, s in enumerate(sentences, 1))


def compose(rng: random.Random, intro: str, core: list[str], extra: list[str], k: int,
            closers: list[str] | None = CLOSERS) -> str:
    """An answer: ``intro``, the ``core`` sentences, then sentences from ``extra`` up to ``k`` in all
    (no repeats), laid out as one paragraph, a numbered list, or headed sections when long;
    half the time one of ``closers`` ends it."""
    pool = [s for s in extra if s not in core]
    body = core[:k] + rng.sample(pool, min(len(pool), max(0, k - len(core))))
    parts = [intro] if intro else []
    if len(body) >= 9:
        cut = [0] + sorted(rng.sample(range(3, len(body) - 2), 2 if len(body) >= 14 else 1))
        cut.append(len(body))
        headings = rng.sample(HEADINGS, len(cut) - 2)
        parts.append(paragraph(rng, body[cut[0]:cut[1]]))
        for heading, a, b in zip(headings, cut[1:], cut[2:]):
            chunk = body[a:b]
            text = numbered(chunk) if rng.random() < 0.5 else paragraph(rng, chunk)
            parts.append(f"{heading}\n{text}")
    elif len(body) >= 4 and rng.random() < 0.3:
        parts.append(numbered(body))
    else:
        parts.append(paragraph(rng, body))
    if closers and rng.random() < 0.5:
        parts.append(rng.choice(closers))
    sep = "\n\n" if "\n" in "".join(parts) or rng.random() < 0.4 else " "
    return sep.join(parts)


def intro_for(rng: random.Random, subject: str) -> str:
    return rng.choice(INTROS).format(x=subject, X=capitalize(subject))


def row(instruction: str, output: str, input_text: str = "") -> dict:
    return {"instruction": instruction, "input": input_text, "output": output}


def generic_row(rng: random.Random) -> dict:
    name = rng.choice(sorted(TOPICS))
    topic = TOPICS[name]
    subject = rng.choice(topic["subjects"])
    template = rng.choice(topic["templates"] + GENERIC_TEMPLATES)
    intro = intro_for(rng, subject) if rng.random() < 0.7 else ""
    k = sentence_count(rng)
    extra = topic["sentences"]
    if k > len(extra):  # a very long answer borrows from a second topic (no sentence repeats)
        second = rng.choice([other for other in sorted(TOPICS) if other != name])
        extra = extra + TOPICS[second]["sentences"]
    output = compose(rng, intro, [], extra, k, ADVICE_CLOSERS)
    return row(capitalize(template.format(x=subject)), output)


def subject_row(rng: random.Random) -> dict:
    """A question about one subject: its own facts first, then general sentences of the topic;
    a long answer goes on with short sections on related subjects of the same topic."""
    topic = SUBJECT_TOPICS[rng.choice(sorted(SUBJECT_TOPICS))]
    subjects = sorted(topic["subjects"])
    subject = rng.choice(subjects)
    template = rng.choice(topic["templates"])
    if topic.get("plain") or rng.random() < 0.3:
        intro = rng.choice(PLAIN_INTROS) if rng.random() < 0.6 else ""
    else:
        intro = intro_for(rng, subject)
    k = sentence_count(rng)
    own, general = topic["subjects"][subject], topic["sentences"]
    first = min(k, len(own) + len(general))
    left = k - first
    closers = None if left > 0 else CLOSERS  # a long answer closes after its sections
    output = compose(rng, intro, own[: max(2, first)], general, first, closers)
    if left > 0:
        sections = [RELATED_INTRO]
        others = [o for o in subjects if o != subject]
        for other in rng.sample(others, len(others)):
            if left <= 0:
                break
            facts = topic["subjects"][other][:max(2, left)]
            sections.append(f"**{capitalize(other)}**\n" + paragraph(rng, facts))
            left -= len(facts)
        if rng.random() < 0.5:
            sections.append(rng.choice(CLOSERS))
        output += "\n\n" + "\n\n".join(sections)
    return row(capitalize(template.format(x=subject)), output)


def list_row(rng: random.Random) -> dict:
    phrasings, items = rng.choice(LISTS)
    n = min(len(items), max(3, sentence_count(rng) + 1))
    chosen = sorted(rng.sample(range(len(items)), n))
    output = rng.choice(LIST_INTROS) + "\n" + numbered([items[i] for i in chosen])
    if rng.random() < 0.4:
        output += "\n\n" + rng.choice(CLOSERS)
    return row(rng.choice(phrasings), output)


def translate_row(rng: random.Random) -> dict:
    direction = rng.choice(sorted(TRANSLATE_INSTRUCTIONS))
    index = {"kk": 0, "en": 1, "ru": 2}
    n = rng.choice([1, 1, 1, 2, 2, 3, 4])
    picked = rng.sample(TRANSLATIONS, n)
    source = " ".join(t[index[direction[0]]] for t in picked)
    target = " ".join(t[index[direction[1]]] for t in picked)
    instruction = rng.choice(TRANSLATE_INSTRUCTIONS[direction])
    return row(instruction, rng.choice(TRANSLATION_PREFIXES) + target, source)


def text_pool(rng: random.Random) -> list[str]:
    """Sentences on one theme: a generic topic's pool, or one subject's facts plus its topic's
    general sentences."""
    name = rng.choice(sorted(TOPICS) + sorted(SUBJECT_TOPICS))
    if name in TOPICS:
        return TOPICS[name]["sentences"]
    topic = SUBJECT_TOPICS[name]
    return topic["subjects"][rng.choice(sorted(topic["subjects"]))] + topic["sentences"]


def summary_row(rng: random.Random) -> dict:
    pool = text_pool(rng)
    text = rng.sample(pool, min(len(pool), 2 + sentence_count(rng)))
    gist = "Мәтіннің негізгі ойы мынада: " + decapitalize(text[0])
    if rng.random() < 0.5:
        gist += " " + rng.choice(["Сонымен қатар, ", "Бұған қоса, "]) + decapitalize(text[1])
    return row(rng.choice(SUMMARY_INSTRUCTIONS), gist, paragraph(rng, text))


def keypoints_row(rng: random.Random) -> dict:
    pool = text_pool(rng)
    text = rng.sample(pool, min(len(pool), 2 + sentence_count(rng)))
    points = [text[i] for i in sorted(rng.sample(range(len(text)), min(len(text), rng.randint(2, 5))))]
    output = "Мәтіндегі негізгі ойлар:\n" + numbered(points)
    return row(rng.choice(KEYPOINT_INSTRUCTIONS), output, paragraph(rng, text))


BUILDERS = {"generic": generic_row, "subject": subject_row, "list": list_row,
            "translate": translate_row, "summary": summary_row, "keypoints": keypoints_row}


# A prompt (instruction + input) longer than this is drawn again: at ~1.6 characters per token
# for Kazakh with Qwen's BPE, 600 characters stay near 400 tokens, so every row keeps some of its
# response inside max_length 512 (Soup refuses rows whose response is truncated away entirely).
MAX_PROMPT_CHARS = 600


def draw_rows(seed: int = SEED):
    """The generator's stream: distinct rows, one after another, without end (the same stream
    for the same ``seed``)."""
    rng = random.Random(seed)
    names, weights = zip(*KINDS)
    seen = set()
    while True:
        r = BUILDERS[rng.choices(names, weights)[0]](rng)
        key = (r["instruction"], r["input"], r["output"])
        if len(r["instruction"]) + len(r["input"]) > MAX_PROMPT_CHARS:
            continue
        if key not in seen:
            seen.add(key)
            yield r


def build_rows(n: int = N_ROWS, seed: int = SEED) -> list[dict]:
    """``n`` distinct rows, the same for the same ``seed`` (pure function of its arguments)."""
    return list(itertools.islice(draw_rows(seed), n))


def dumps(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def write(path: Path, rows: list[dict]) -> None:
    Path(path).write_bytes(dumps(rows).encode("utf-8"))


def messages(r: dict) -> list[dict]:
    """The conversation Soup 0.77.0 builds from an alpaca row (soup_cli/data/formats.py)."""
    user = f"{r['instruction']}\n{r['input']}".strip() if r.get("input") else r["instruction"]
    return [{"role": "user", "content": user}, {"role": "assistant", "content": r["output"]}]


def token_lengths(rows: list[dict], tokenizer) -> list[int]:
    """Token count of each row after the chat template (Qwen adds its default system prompt)."""
    out = []
    for r in rows:
        text = tokenizer.apply_chat_template(messages(r), tokenize=False)
        out.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


def stats(lengths: list[int], limit: int = MAX_LENGTH) -> dict:
    s = sorted(lengths)
    over = sum(1 for x in s if x > limit)
    return {"rows": len(s), "min": s[0], "median": s[len(s) // 2], "p90": s[int(0.9 * (len(s) - 1))],
            "max": s[-1], "over_limit": over, "over_fraction": round(over / len(s), 4)}


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line]


# Shape variants: which token lengths (after the chat template) a shape keeps. Under 96 tokens the
# stream runs short of distinct rows (its one-sentence translations repeat), hence 112.
SHORT_LIMIT = 112
SHAPES = {"shipped": None,
          "long": lambda n: n > MAX_LENGTH,   # every row truncated to max_length: no padding
          "short": lambda n: n < SHORT_LIMIT}
_CHUNK = 256          # rows measured at a time
_MAX_DRAWS = 100_000  # a shape that keeps (almost) nothing is an error, not an endless loop


def build_shape_rows(shape: str, tokenizer=None, n: int = N_ROWS, seed: int = SEED) -> list[dict]:
    """``n`` rows of ``shape``: the first ``n`` rows of the seeded stream (``draw_rows``) whose
    token length fits the shape (``shipped``: every row, i.e. ``build_rows``). A pure function of
    its arguments; ``tokenizer`` defaults to the project's offline Qwen2.5 tokenizer."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    keep = SHAPES[shape]
    if keep is None:
        return build_rows(n, seed)
    if tokenizer is None:
        from workload.tokenizer import load_tokenizer

        tokenizer = load_tokenizer()
    stream, rows, drawn = draw_rows(seed), [], 0
    while len(rows) < n:
        if drawn >= _MAX_DRAWS:
            raise RuntimeError(f"shape {shape}: only {len(rows)} of {n} rows in {drawn} drawn")
        chunk = list(itertools.islice(stream, _CHUNK))
        drawn += len(chunk)
        rows += [r for r, length in zip(chunk, token_lengths(chunk, tokenizer)) if keep(length)]
    return rows[:n]


def make_shape_dataset(shape: str, path, n: int = N_ROWS, tokenizer=None) -> Path:
    """Write the ``shape`` variant (``n`` rows) to ``path`` (JSONL, the committed file's format);
    returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write(path, build_shape_rows(shape, tokenizer, n))
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the generated rows to this JSONL file")
    parser.add_argument("--stats", action="store_true",
                        help="print token-length stats (of --data if given, else of the generated rows)")
    parser.add_argument("--data", type=Path, help="with --stats: measure this JSONL file instead")
    parser.add_argument("--tokenizer", default=None, help="a real Qwen2.5 tokenizer dir (optional)")
    parser.add_argument("--shape", choices=list(SHAPES), default="shipped",
                        help="which rows: the committed file's (shipped, default), every row over 512 "
                        f"tokens (long) or every row under {SHORT_LIMIT} tokens (short)")
    args = parser.parse_args(argv)
    if not args.out and not args.stats:
        parser.error("nothing to do: pass --out FILE and/or --stats")
    tokenizer = None
    if args.stats or args.shape != "shipped":
        from transformers import AutoTokenizer

        from workload.tokenizer import load_tokenizer

        tokenizer = (AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer
                     else load_tokenizer())
    rows = build_shape_rows(args.shape, tokenizer)
    if args.out:
        write(args.out, rows)
        print(f"wrote {len(rows)} rows to {args.out}")
    if args.stats:
        measured = read_rows(args.data) if args.data else rows
        print(json.dumps(stats(token_lengths(measured, tokenizer))))


if __name__ == "__main__":
    main()
