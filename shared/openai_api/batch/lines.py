"""A batch's input file, line by line: what OpenAI checks before a batch runs. A file that breaks a
rule fails the batch with ``errors`` naming each offending line (1-based), as does a line Python
cannot parse (nested past ``MAX_JSON_DEPTH``, an integer past ``MAX_NUMBER_DIGITS``); the body
itself is not checked here: a body the endpoint refuses is a 400 in that line's result (the error
file)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from shared.openai_api.json_body import MAX_JSON_DEPTH, JsonRefused, JsonTooDeep, load_json
from shared.protocol.batch import BatchLineError

MAX_LINES = 50_000
MAX_ERRORS = 100  # reported per file; a file broken everywhere is named by its first lines


@dataclass(frozen=True)
class InputLine:
    line: int        # 1-based
    custom_id: str
    url: str
    body: str        # the request body as JSON text


def parse_input(data: bytes, endpoint: str, *, max_line_bytes: int) -> tuple[list[InputLine], list[BatchLineError]]:
    """The lines of a JSONL input file for a batch on ``endpoint``, or the errors that fail it
    (blank lines are skipped). Each line: ``{"custom_id": str, "method": "POST", "url":
    endpoint, "body": {...}}``, custom_ids unique within the file."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [], [BatchLineError(code="invalid_file", message=f"the file is not UTF-8 ({exc.reason} at byte {exc.start})")]
    lines, errors, seen = [], [], {}
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        if len(raw.encode()) > max_line_bytes:
            errors.append(BatchLineError(code="line_too_large", line=number,
                                         message=f"line {number} has {len(raw.encode())} bytes, more than {max_line_bytes}"))
        elif isinstance(parsed := _check_line(raw, number, endpoint), BatchLineError):
            errors.append(parsed)
        elif parsed.custom_id in seen:
            errors.append(BatchLineError(code="duplicate_custom_id", line=number, param="custom_id",
                                         message=f"line {number}: custom_id {parsed.custom_id!r} is already used "
                                                 f"on line {seen[parsed.custom_id]}"))
        else:
            seen[parsed.custom_id] = number
            lines.append(parsed)
        if len(errors) >= MAX_ERRORS:
            break
    if not errors and not lines:
        errors.append(BatchLineError(code="empty_file", message="the input file has no requests"))
    if len(lines) > MAX_LINES:
        errors.append(BatchLineError(code="too_many_lines", message=f"{len(lines)} requests, more than {MAX_LINES}"))
    return ([] if errors else lines), errors


def _check_line(raw: str, number: int, endpoint: str) -> InputLine | BatchLineError:
    def error(code: str, message: str, param: str | None = None) -> BatchLineError:
        return BatchLineError(code=code, line=number, param=param, message=f"line {number}: {message}")

    try:
        # the body sits one level in; a string that is no Unicode text is left to the endpoint,
        # which refuses it as a 400 in the line's result
        obj = load_json(raw, MAX_JSON_DEPTH + 1, unicode_only=False)
    except JsonTooDeep:
        # refused here, not in the error file: a line Python cannot even parse has no custom_id to report
        return error("invalid_json_line", f"the body is nested deeper than {MAX_JSON_DEPTH} levels", "body")
    except JsonRefused as exc:  # likewise (an integer of thousands of digits: once a batch held in validating)
        return error("invalid_json_line", f"the line {exc}")
    except json.JSONDecodeError as exc:
        return error("invalid_json_line", f"not valid JSON ({exc.msg} at column {exc.colno})")
    if not isinstance(obj, dict):
        return error("invalid_json_line", "not a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return error("missing_required_parameter", "custom_id must be a non-empty string", "custom_id")
    if obj.get("method") != "POST":
        return error("invalid_method", f"method must be \"POST\", got {obj.get('method')!r}", "method")
    if obj.get("url") != endpoint:
        return error("mismatched_endpoint", f"url {obj.get('url')!r} is not the batch's endpoint {endpoint!r}", "url")
    if not isinstance(obj.get("body"), dict):
        return error("missing_required_parameter", "body must be a JSON object", "body")
    return InputLine(line=number, custom_id=custom_id, url=endpoint, body=json.dumps(obj["body"]))
