"""Offline batch mode: `trireme generate --input prompts.jsonl --output out.jsonl`.

Each input line is a JSON object with a "prompt" string and, optionally, its own settings
("max_tokens", "temperature", "top_k", "top_p", "seed", "greedy", "stop", "ignore_eos", and an
"id" of any JSON value that is copied to the output). Every line is checked before anything runs;
a bad one stops the run with `file:line: what is wrong`. All prompts go through the serving
engine together (continuous batching); the output has one line per input line, in input order:

    {"id": ..., "prompt": ..., "text": ..., "finish_reason": "stop" | "length",
     "prompt_tokens": n, "completion_tokens": m}

written to a temporary file and renamed at the end, so a failed run leaves no partial output.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from trireme.checkpoint.files import current_umask
from trireme.data.tokenizer_base import Tokenizer
from trireme.errors import TriremeError
from trireme.serving.engine import Engine
from trireme.serving.sampling import SamplingParams
from trireme.serving.text import encodable

# field -> the JSON types it takes (bool is not a number here)
FIELDS: dict[str, tuple[type, ...]] = {
    "prompt": (str,), "max_tokens": (int,), "temperature": (int, float), "top_k": (int,),
    "top_p": (int, float), "seed": (int,), "greedy": (bool,), "stop": (str, list),
    "ignore_eos": (bool,), "id": (object,),
}


def read_prompts(path: str, defaults: SamplingParams, engine: Engine,
                 tokenizer: Tokenizer) -> list[tuple[dict[str, Any], list[int], SamplingParams]]:
    """(line object, prompt ids, settings) per non-empty line; TriremeError `path:line: ...`."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TriremeError(f"--input {path}: cannot read it ({e})") from None
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append(_parse(line, defaults, engine, tokenizer))
        except TriremeError as e:
            raise TriremeError(f"{path}:{number}: {e}") from None
    if not out:
        raise TriremeError(f"--input {path} holds no prompts (one JSON object per line)")
    return out


def _parse(line: str, defaults: SamplingParams, engine: Engine, tokenizer: Tokenizer):
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise TriremeError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # a 5,000-digit number, nesting too deep
        raise TriremeError(f"not valid JSON ({str(e)[:120]})") from None
    if not isinstance(item, dict) or "prompt" not in item:
        raise TriremeError('each line must be a JSON object with a "prompt" string')
    settings = {}
    for key, value in item.items():
        if key not in FIELDS:
            raise TriremeError(f"unknown field {key!r}; fields: {', '.join(FIELDS)}")
        kinds = FIELDS[key]
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise TriremeError(f"{key} = {json.dumps(value)[:40]} has the wrong type "
                               f"(want {' or '.join(k.__name__ for k in kinds)})")
        if key not in ("prompt", "id"):
            settings[key] = value
    stop = settings.get("stop", list(defaults.stop))
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise TriremeError("stop must be a string or a list of strings")
    for name, text in [("prompt", item["prompt"]), *(("stop", s) for s in stop)]:
        if not encodable(text):
            raise TriremeError(f"{name} holds invalid Unicode (a lone surrogate escape such "
                               "as \\ud800)")
    params = replace(defaults, **{**settings, "stop": tuple(stop)})
    problem = params.problem()
    if problem:
        raise TriremeError(problem)
    ids = tokenizer.encode(item["prompt"]) or [tokenizer.eod]
    engine.check_prompt(ids)
    return item, ids, params


def check_output(output_path: str, input_path: str) -> None:
    """A TriremeError now, before any prompt runs, if `output_path` cannot be the output file:
    a directory, a path under a file, a device or pipe (the answers are renamed over it), the
    input file itself, or a folder no file can be made in (found at the end, that would lose
    every answer)."""
    target = Path(output_path)
    if target.is_dir():
        raise TriremeError(f"--output {output_path} is a directory; give a file name")
    parent = next((p for p in (target.parent, *target.parent.parents) if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise TriremeError(f"--output {output_path}: {parent} is not a directory")
    if target.exists() and not target.is_file():  # renamed over: /dev/null would be replaced
        raise TriremeError(f"--output {output_path} is not a regular file (a device, a pipe); "
                           "give a file name")
    if target.exists() and Path(input_path).exists() and target.samefile(input_path):
        raise TriremeError(f"--output {output_path} is the --input file; give another name "
                           "(the answers would replace the prompts)")
    try:  # a file that is gone at once: the folder (or the one it will be made in) is writable
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as e:
        raise TriremeError(f"--output {output_path}: cannot write in {parent} "
                           f"({e.strerror or e})") from None


def generate_file(input_path: str, output_path: str, engine: Engine, tokenizer: Tokenizer,
                  defaults: SamplingParams, write: bool = True) -> int:
    """Run every prompt of `input_path`, write `output_path` atomically (unless not `write`: a
    tensor-parallel rank other than the first); the number of lines."""
    items = read_prompts(input_path, defaults, engine, tokenizer)
    requests = engine.generate([ids for _, ids, _ in items], [p for _, _, p in items])
    if not write:
        return len(items)
    records = []
    for (item, ids, _), request in zip(items, requests):
        record = {"prompt": item["prompt"], "text": request.text.text,
                  "finish_reason": request.finish_reason, "prompt_tokens": len(ids),
                  "completion_tokens": len(request.output_ids)}
        records.append({"id": item["id"], **record} if "id" in item else record)
    try:
        write_lines(Path(output_path), records)
    except OSError as e:  # e.g. the disk filled up: one line, no partial file
        raise TriremeError(f"--output {output_path}: cannot write it ({e.strerror or e})"
                           ) from None
    return len(items)


def write_lines(target: Path, records: list[dict[str, Any]]) -> None:
    """`records` as JSON lines in `target`, through a temporary file renamed at the end."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())  # as open() would make it (mkstemp: 0600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
